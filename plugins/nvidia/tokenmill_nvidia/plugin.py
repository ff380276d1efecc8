"""The nvidia platform plugin: tokenmill on NVIDIA GPUs with the shared Triton kernels.

Announced through the entry point group `tokenmill.platforms` (../pyproject.toml). The
kernels and the hook bodies live in `tokenmill_triton` (shared with the rocm plugin; see
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

from collections.abc import Callable

import pluggy
import torch

from tokenmill.platforms.interfaces import (
    Allocator,
    AllocatorPurpose,
    AttentionBackend,
    Communicator,
    DetectionResult,
    GraphCapture,
    HardwareSpec,
    Platform,
)
from tokenmill_nvidia.allocator import KVCACHE_ENV
from tokenmill_nvidia.communicator import GPU_BACKENDS
from tokenmill_triton.configs import KernelConfigs
from tokenmill_triton.platform_kit import (  # noqa: F401 - part of this plugin's surface
    GPU_CAPABILITIES,
    INTERPRETER_CAPABILITIES,
    GpuPlugin,
    Probe,
)

hookimpl = pluggy.HookimplMarker("tokenmill")
NAME = "nvidia"


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


KIT = GpuPlugin(NAME, _interpreter_configs, _gpu_configs, GPU_BACKENDS, KVCACHE_ENV, _probe,
                _gpu_platform, _device_spec)


@hookimpl
def tokenmill_api_version() -> str:
    return "1.2"  # 1.2: tokenmill_graph_capture returns a GraphCapture


@hookimpl
def tokenmill_detect() -> DetectionResult:
    return KIT.detect()


@hookimpl
def tokenmill_platform() -> Platform:
    return KIT.platform()


@hookimpl
def tokenmill_attention_backends(platform: Platform) -> list[AttentionBackend]:
    return KIT.attention_backends(platform)


@hookimpl
def tokenmill_communicator(platform: Platform, group: object | None) -> Communicator:
    return KIT.communicator(platform, group)


@hookimpl
def tokenmill_allocator(platform: Platform, purpose: AllocatorPurpose) -> Allocator:
    return KIT.allocator(platform, purpose)


@hookimpl
def tokenmill_ops(platform: Platform) -> dict[str, Callable]:
    return KIT.ops(platform)


@hookimpl
def tokenmill_hardware_spec(platform: Platform) -> HardwareSpec:
    return KIT.hardware_spec(platform)


@hookimpl
def tokenmill_graph_capture(platform: Platform) -> GraphCapture | None:
    return KIT.graph_capture(platform)


@hookimpl
def tokenmill_waivers(platform: Platform) -> list[tuple[str, str]]:
    return []
