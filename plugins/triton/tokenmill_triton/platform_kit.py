"""The hook bodies the nvidia and rocm plugins share, parametrised by each plugin's own parts.

A plugin builds one `GpuPlugin` with what it owns (its name, launch settings, collectives
backends, KV-arena limit variable, probe, hardware table, and how its GPU platform is
described) and its pluggy hooks (which must stay in its own plugin.py) call the methods
here. Both plugins run in two modes decided by their probe: a GPU (torch's "cuda" device,
HIP included) or `TRITON_INTERPRET=1`, the same kernels in Triton's interpreter on CPU
tensors (device "cpu", gloo). Importing this module imports neither triton nor initialises
the device; the methods import what they need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
    KernelBuild,
    MemoryInfo,
    Platform,
)
from tokenmill_triton.configs import KernelConfigs, interpreter_mode

hookimpl = pluggy.HookimplMarker("tokenmill")

KINDS = frozenset({AttentionKind.FULL, AttentionKind.SLIDING_WINDOW, AttentionKind.LINEAR,
                   AttentionKind.MLA})
FP8_KV = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
GPU_CAPABILITIES = Capabilities(
    attention_kinds=KINDS,
    dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
    block_sizes=frozenset({16, 32, 64, 128}),
    head_sizes=frozenset({64, 128, 256}),
    collectives=True,
    graphs=True,  # CUDA/HIP graphs of the decode step (tokenmill_triton.graphs); never interpreted
    sleep_mode=True,
    kv_cache_dtypes=FP8_KV,  # attention.py, mla.py: written quantized, read dequantized
)
# The interpreter runs every program in Python (~1 ms per tensor op), so the certified set
# is smaller there: float32 (exact) and bfloat16 (the GPU default, through float32-upcast
# tiles), one page size smaller than the key tile; float16 and other page sizes are
# checked by tests/triton/kernel_cases.py on the same kernels.
INTERPRETER_CAPABILITIES = Capabilities(
    attention_kinds=KINDS,
    dtypes=frozenset({torch.float32, torch.bfloat16}),
    block_sizes=frozenset({16}),
    head_sizes=frozenset({64, 128, 256}),
    collectives=True,
    graphs=False,
    sleep_mode=True,
    kv_cache_dtypes=FP8_KV,
)
INTERPRETER_BACKENDS = frozenset({"gloo"})
# Allocator limits as fractions of free (KV arena) or total (weights) memory on a GPU, and of
# available host memory in interpreter mode (where everything is host memory).
GPU_FRACTIONS = {AllocatorPurpose.KV_ARENA: 0.9, AllocatorPurpose.WEIGHTS: 1.0}
HOST_FRACTIONS = {
    AllocatorPurpose.KV_ARENA: 0.4,
    AllocatorPurpose.WEIGHTS: 0.9,
    AllocatorPurpose.HOST_STAGING: 0.1,
}
INTERPRETER_REASON = (
    "Triton interpreter on CPU (TRITON_INTERPRET=1): the plugin's Triton kernels run in "
    "Python on CPU tensors, for correctness checks only"
)


@dataclass(frozen=True, slots=True)
class Probe:
    """What a probe found: whether the platform can run, in which mode, and why."""

    available: bool
    interpreter: bool
    reason: str


def common_probe() -> Probe | None:
    """The checks every GPU probe starts with: interpreter mode (always available) and an
    installed triton; None when the plugin's own device checks decide."""
    import importlib.util

    if interpreter_mode():
        return Probe(True, True, INTERPRETER_REASON)
    if importlib.util.find_spec("triton") is None:
        return Probe(False, False, "triton is not installed (pip install triton)")
    return None


def is_interpreter(platform: Platform) -> bool:
    return platform.device_type == "cpu"


def gpu_memory_info() -> MemoryInfo:
    free, total = torch.cuda.mem_get_info()
    return MemoryInfo(total_bytes=total, free_bytes=free)


def host_memory_info() -> MemoryInfo:
    import psutil

    memory = psutil.virtual_memory()
    return MemoryInfo(total_bytes=memory.total, free_bytes=memory.available)


@dataclass(frozen=True, slots=True)
class GpuPlugin:
    """One GPU platform plugin: its own parts, and the hooks over them.

    `api_version` is the plugin API version the plugin declares (the oldest that has what
    these hooks use: tokenmill.platforms.versions); `interpreter_configs` and
    `gpu_configs()` are its launch settings; `gpu_backends` the torch.distributed backends
    its collectives accept on a GPU; `kvcache_env` the variable that fixes its KV arena in
    GiB; `probe()` its device probe; `gpu_platform()` its GPU's (default dtype, version
    text); `device_spec()` its hardware table's entry for the current device;
    `named_spec(name)` the table's entry for a device asked for by name (the planner; no
    device touched). The callables run only inside hooks, so they may touch the device.
    `kernel_builds()` is not a hook yet: it becomes `tokenmill_kernel_builds` (API 1.5)
    once the plugins' compile records are clean.
    """

    name: str
    api_version: str
    interpreter_configs: Callable[[], KernelConfigs]
    gpu_configs: Callable[[], KernelConfigs]
    gpu_backends: frozenset[str]
    kvcache_env: str
    probe: Callable[[], Probe]
    gpu_platform: Callable[[], tuple[torch.dtype, str]]
    device_spec: Callable[[], HardwareSpec]
    named_spec: Callable[[str], HardwareSpec | None]
    # real target -> its launch settings as 'module:ATTRIBUTE', compiled ahead of time for
    # the conformance suite (tokenmill_kernel_builds)
    build_targets: tuple[tuple[str, str], ...] = ()

    @hookimpl
    def tokenmill_api_version(self) -> str:
        return self.api_version

    def configs(self, platform: Platform) -> KernelConfigs:
        return self.interpreter_configs() if is_interpreter(platform) else self.gpu_configs()

    @hookimpl
    def tokenmill_detect(self) -> DetectionResult:
        found = self.probe()
        return DetectionResult(found.available, found.reason)

    @hookimpl
    def tokenmill_platform(self) -> Platform:
        triton_version = metadata.version("triton")
        if self.probe().interpreter:
            return Platform(
                name=self.name,
                device_type="cpu",
                capabilities=INTERPRETER_CAPABILITIES,
                default_dtype=torch.float32,
                memory_info=host_memory_info,
                version=f"triton {triton_version} interpreter on CPU, float32 and bfloat16 "
                "checked (bf16 tiles upcast to float32 before tl.dot, float32 -> bf16 casts "
                "rounded to nearest even in-kernel); torch "
                + torch.__version__,
                long_prefill_token_threshold=256,
            )
        default_dtype, details = self.gpu_platform()
        return Platform(
            name=self.name,
            device_type="cuda",  # torch's device type for HIP too
            capabilities=GPU_CAPABILITIES,
            default_dtype=default_dtype,
            memory_info=gpu_memory_info,
            version=f"triton {triton_version}, {details}",
        )

    @hookimpl
    def tokenmill_attention_backends(self, platform: Platform) -> list[AttentionBackend]:
        from tokenmill_triton.attention import TritonPagedAttention
        from tokenmill_triton.linear_attention import TritonLinearAttention
        from tokenmill_triton.mla import TritonMLAAttention

        configs = self.configs(platform)
        paged = sorted(KINDS - {AttentionKind.MLA, AttentionKind.LINEAR}, key=str)
        return [TritonPagedAttention(kind, configs, self.name) for kind in paged] + [
            TritonLinearAttention(configs, self.name), TritonMLAAttention(configs, self.name)]

    @hookimpl
    def tokenmill_communicator(self, platform: Platform, group: object | None) -> Communicator:
        from tokenmill_triton.distributed import make_communicator

        backends = INTERPRETER_BACKENDS if is_interpreter(platform) else self.gpu_backends
        return make_communicator(group, backends, self.name)

    @hookimpl
    def tokenmill_allocator(self, platform: Platform, purpose: AllocatorPurpose) -> Allocator:
        from tokenmill_triton.memory import make_device_allocator

        return make_device_allocator(purpose, is_interpreter(platform), self.name,
                                     self.kvcache_env, GPU_FRACTIONS, HOST_FRACTIONS)

    @hookimpl
    def tokenmill_ops(self, platform: Platform) -> dict[str, Callable]:
        from tokenmill_triton.ops import make_ops

        return make_ops(self.configs(platform), self.name)

    @hookimpl
    def tokenmill_hardware_spec(
        self, platform: Platform | None, device: str | None
    ) -> HardwareSpec | None:
        if device is not None:
            return self.named_spec(device)
        assert platform is not None, "the active device's spec needs the active platform"
        if not is_interpreter(platform):
            return self.device_spec()
        # nominal: the interpreter's speed says nothing about a GPU (T5 is not its job)
        return HardwareSpec(
            name="Triton interpreter on CPU (nominal)",
            peak_flops={"float32": 1e9, "float16": 1e9, "bfloat16": 1e9},
            memory_bandwidth=1e9,
            memory_bytes=host_memory_info().total_bytes,
        )

    def kernel_builds(self) -> list[KernelBuild]:
        """Every kernel and launch configuration compiled for each of `build_targets`
        (tokenmill_triton.aot: no GPU needed, whatever mode the platform runs in)."""
        from tokenmill_triton.aot import compile_plugin

        records = compile_plugin(dict(self.build_targets))
        return [KernelBuild(**record) for record in records]

    @hookimpl
    def tokenmill_graph_capture(self, platform: Platform) -> GraphCapture | None:
        if is_interpreter(platform):  # graphs need a GPU stream; the interpreter has none
            return None
        from tokenmill_triton.graphs import CudaGraphCapture

        return CudaGraphCapture()  # torch.cuda.CUDAGraph records a HIP graph on ROCm

    @hookimpl
    def tokenmill_waivers(self, platform: Platform) -> list[tuple[str, str]]:
        return []
