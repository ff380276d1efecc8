"""The rocm platform plugin: tokenmill on AMD Instinct GPUs with the shared Triton kernels.

Announced through the entry point group `tokenmill.platforms` (../pyproject.toml). The
kernels and the hook bodies live in `tokenmill_triton` (shared with the nvidia plugin; see
`tokenmill_triton.platform_kit`); this plugin keeps its launch settings (configs.py),
collectives backend (communicator.py: RCCL), KV-arena variable (allocator.py), hardware
table (hardware.py) and probe (probe.py). Importing it imports neither triton nor
initialises HIP; the hooks import what they need.

Two modes, decided by the probe:
- a GPU: torch's "cuda" device (HIP behind it), RCCL, the caching allocator, bf16, HIP
  graphs of the decode step per padded batch-size bucket;
- `TRITON_INTERPRET=1`: the same Triton kernels in Triton's interpreter on CPU tensors
  (device "cpu", gloo), so CI without a GPU certifies the kernels' logic with the gfx942
  launch settings. Triton 3.9's interpreter gets bf16 `tl.dot` wrong, so bf16 tiles are
  upcast to float32 there (`KernelConfigs.upcast_bf16_dot`); the platform version says so.
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
from tokenmill_rocm.allocator import KVCACHE_ENV
from tokenmill_rocm.communicator import GPU_BACKENDS
from tokenmill_triton.configs import KernelConfigs
from tokenmill_triton.platform_kit import (  # noqa: F401 - part of this plugin's surface
    GPU_CAPABILITIES,
    INTERPRETER_CAPABILITIES,
    GpuPlugin,
    Probe,
)

hookimpl = pluggy.HookimplMarker("tokenmill")
NAME = "rocm"


def _interpreter_configs() -> KernelConfigs:
    from tokenmill_rocm import configs

    return configs.INTERPRETER


def _gpu_configs() -> KernelConfigs:
    from tokenmill_rocm import configs

    return configs.for_arch(_gcn_arch())


def _gcn_arch() -> str:
    return getattr(torch.cuda.get_device_properties(torch.cuda.current_device()),
                   "gcnArchName", "")


def _probe() -> Probe:
    from tokenmill_rocm.probe import probe

    return probe()


def _gpu_platform() -> tuple[torch.dtype, str]:
    return torch.bfloat16, f"HIP {torch.version.hip}, {_gcn_arch().split(':')[0]}"


def _device_spec() -> HardwareSpec:
    from tokenmill_rocm.hardware import device_spec

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
