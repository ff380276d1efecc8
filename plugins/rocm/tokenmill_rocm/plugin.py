"""The rocm platform plugin: tokenmill on AMD Instinct GPUs with the shared Triton kernels.

Announced through the entry point group `tokenmill.platforms` (../pyproject.toml). The
kernels live in `tokenmill_triton` (shared with the nvidia plugin); this plugin keeps its
launch settings (configs.py), collectives (communicator.py: RCCL), allocators
(allocator.py), hardware table (hardware.py) and probe (probe.py). Importing it imports
neither triton nor initialises HIP; the hooks import what they need.

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
from importlib import metadata

import pluggy
import torch

from tokenmill.platforms.interfaces import (
    Allocator,
    AllocatorPurpose,
    AttentionBackend,
    AttentionKind,
    Capabilities,
    Communicator,
    DetectionResult,
    GraphCapture,
    HardwareSpec,
    MemoryInfo,
    Platform,
)

hookimpl = pluggy.HookimplMarker("tokenmill")
NAME = "rocm"

_KINDS = frozenset({AttentionKind.FULL, AttentionKind.SLIDING_WINDOW})
_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
GPU_CAPABILITIES = Capabilities(
    attention_kinds=_KINDS,
    dtypes=_DTYPES,
    block_sizes=frozenset({16, 32, 64, 128}),
    head_sizes=frozenset({64, 128, 256}),
    collectives=True,
    graphs=True,  # HIP graphs of the decode step (tokenmill_triton.graphs); never interpreted
    sleep_mode=True,
)
# The interpreter runs every program in Python (~1 ms per tensor op), so the certified set
# is smaller there: float32 (exact) and bfloat16 (the GPU default, through float32-upcast
# tiles), one page size smaller than the key tile; float16 and other page sizes are
# checked by tests/triton/kernel_cases.py on the same kernels.
INTERPRETER_CAPABILITIES = Capabilities(
    attention_kinds=_KINDS,
    dtypes=frozenset({torch.float32, torch.bfloat16}),
    block_sizes=frozenset({16}),
    head_sizes=frozenset({64, 128, 256}),
    collectives=True,
    graphs=False,
    sleep_mode=True,
)


def _interpreter(platform: Platform) -> bool:
    return platform.device_type == "cpu"


def _configs(platform: Platform):
    from tokenmill_rocm import configs

    if _interpreter(platform):
        return configs.INTERPRETER
    return configs.for_arch(_gcn_arch())


def _gcn_arch() -> str:
    return getattr(torch.cuda.get_device_properties(torch.cuda.current_device()),
                   "gcnArchName", "")


def _gpu_memory_info() -> MemoryInfo:
    free, total = torch.cuda.mem_get_info()
    return MemoryInfo(total_bytes=total, free_bytes=free)


def _host_memory_info() -> MemoryInfo:
    import psutil

    memory = psutil.virtual_memory()
    return MemoryInfo(total_bytes=memory.total, free_bytes=memory.available)


@hookimpl
def tokenmill_api_version() -> str:
    return "1.2"  # 1.2: tokenmill_graph_capture returns a GraphCapture


@hookimpl
def tokenmill_detect() -> DetectionResult:
    from tokenmill_rocm.probe import probe

    found = probe()
    return DetectionResult(found.available, found.reason)


@hookimpl
def tokenmill_platform() -> Platform:
    from tokenmill_rocm.probe import probe

    triton_version = metadata.version("triton")
    if probe().interpreter:
        return Platform(
            name=NAME,
            device_type="cpu",
            capabilities=INTERPRETER_CAPABILITIES,
            default_dtype=torch.float32,
            memory_info=_host_memory_info,
            version=f"triton {triton_version} interpreter on CPU, float32 and bfloat16 checked "
            "(bf16 tiles upcast to float32 before tl.dot); torch " + torch.__version__,
            long_prefill_token_threshold=256,
        )
    arch = _gcn_arch().split(":")[0]
    return Platform(
        name=NAME,
        device_type="cuda",  # torch's device type for HIP too
        capabilities=GPU_CAPABILITIES,
        default_dtype=torch.bfloat16,
        memory_info=_gpu_memory_info,
        version=f"triton {triton_version}, HIP {torch.version.hip}, {arch}",
    )


@hookimpl
def tokenmill_attention_backends(platform: Platform) -> list[AttentionBackend]:
    from tokenmill_triton.attention import TritonPagedAttention

    configs = _configs(platform)
    return [TritonPagedAttention(kind, configs, NAME) for kind in sorted(_KINDS, key=str)]


@hookimpl
def tokenmill_communicator(platform: Platform, group: object | None) -> Communicator:
    from tokenmill_rocm.communicator import make_communicator

    return make_communicator(group, _interpreter(platform))


@hookimpl
def tokenmill_allocator(platform: Platform, purpose: AllocatorPurpose) -> Allocator:
    from tokenmill_rocm.allocator import make_allocator

    return make_allocator(purpose, _interpreter(platform))


@hookimpl
def tokenmill_ops(platform: Platform) -> dict[str, Callable]:
    from tokenmill_triton.ops import make_ops

    return make_ops(_configs(platform))


@hookimpl
def tokenmill_hardware_spec(platform: Platform) -> HardwareSpec:
    if _interpreter(platform):
        memory = _host_memory_info()
        # nominal: the interpreter's speed says nothing about a GPU (T5 is not its job)
        return HardwareSpec(
            name="Triton interpreter on CPU (nominal)",
            peak_flops={"float32": 1e9, "float16": 1e9, "bfloat16": 1e9},
            memory_bandwidth=1e9,
            memory_bytes=memory.total_bytes,
        )
    from tokenmill_rocm.hardware import device_spec

    return device_spec(torch.cuda.current_device())


@hookimpl
def tokenmill_graph_capture(platform: Platform) -> GraphCapture | None:
    if _interpreter(platform):  # graphs need a GPU stream; the interpreter has none
        return None
    from tokenmill_triton.graphs import CudaGraphCapture

    return CudaGraphCapture()  # torch.cuda.CUDAGraph records a HIP graph on ROCm


@hookimpl
def tokenmill_waivers(platform: Platform) -> list[tuple[str, str]]:
    return []
