"""The nvidia platform plugin: tokenmill on NVIDIA GPUs with the shared Triton kernels.

Announced through the entry point group `tokenmill.platforms` (../pyproject.toml). The
kernels and the hooks live in `tokenmill_triton` (shared with the rocm plugin; see
`tokenmill_triton.platform_kit`); this plugin keeps its launch settings (configs.py),
collectives backend (communicator.py), KV-arena variable (allocator.py), hardware table
(hardware.py) and probe (probe.py). Importing it imports neither triton nor initialises
CUDA; the hooks import what they need.

Two modes, decided by the probe:
- a GPU: device "cuda", NCCL, the CUDA caching allocator, bf16 by default (fp16 before
  Ampere), CUDA graphs of the decode step per padded batch-size bucket
  (tokenmill_triton.graphs);
- `TRITON_INTERPRET=1`: the same Triton kernels in Triton's interpreter on CPU tensors
  (device "cpu", gloo), so CI without a GPU certifies the kernels' logic. Triton 3.9's
  interpreter gets bf16 `tl.dot` wrong, so bf16 tiles are upcast to float32 there
  (`KernelConfigs.upcast_bf16_dot`); the platform version says so, and the certificate
  lists the dtypes that were checked.
"""

from __future__ import annotations

import torch

from tokenmill.platforms.interfaces import HardwareSpec
from tokenmill_nvidia.allocator import KVCACHE_ENV
from tokenmill_nvidia.communicator import GPU_BACKENDS
from tokenmill_triton.configs import KernelConfigs
from tokenmill_triton.platform_kit import (  # noqa: F401 - part of this plugin's surface
    GPU_CAPABILITIES,
    INTERPRETER_CAPABILITIES,
    GpuPlugin,
    Probe,
)

NAME = "nvidia"
API_VERSION = "1.8"  # 1.7: FP8 KV caches (Capabilities.kv_cache_dtypes); 1.8: prepack_quantized_linear


def _interpreter_configs() -> KernelConfigs:
    from tokenmill_nvidia import configs

    return configs.INTERPRETER


def _gpu_configs() -> KernelConfigs:
    from tokenmill_nvidia import configs

    return configs.for_capability(torch.cuda.get_device_capability()[0])


def _probe() -> Probe:
    from tokenmill_nvidia.probe import probe

    return probe()


def _gpu_platform() -> tuple[torch.dtype, str]:
    major, minor = torch.cuda.get_device_capability()
    dtype = torch.bfloat16 if major >= 8 else torch.float16
    return dtype, f"CUDA {torch.version.cuda}, sm{major}{minor}"


def _device_spec() -> HardwareSpec:
    from tokenmill_nvidia.hardware import device_spec

    return device_spec(torch.cuda.current_device())


def _named_spec(device: str) -> HardwareSpec | None:
    from tokenmill_nvidia.hardware import named_spec

    return named_spec(device)


# the launch settings compiled ahead of time for the conformance suite, by target
BUILD_TARGETS = (("sm_90", "tokenmill_nvidia.configs:HOPPER"),
                 ("sm_100", "tokenmill_nvidia.configs:BLACKWELL"))
# the plugin: GpuPlugin's methods are its hooks; the version is the oldest that has what
# they use (1.3: LINEAR and MLA backends, Allocator.sleep/wake; 1.4: tokenmill_hardware_spec
# answers a device named from its table; tokenmill_kernel_builds, 1.5, is held back until
# the compile records are clean: plugins/triton/compile_records.py calls kernel_builds())
plugin = GpuPlugin(NAME, API_VERSION, _interpreter_configs, _gpu_configs, GPU_BACKENDS,
                   KVCACHE_ENV, _probe, _gpu_platform, _device_spec, _named_spec, BUILD_TARGETS)
