"""The CPU platform plugin: the canonical example of a tokenmill platform plugin.

The registry imports this module through the entry point group `tokenmill.platforms`
(see ../pyproject.toml) and calls the hooks below; each is documented in
`tokenmill.platforms.hookspecs`. Importing it has no side effects, and heavier modules
are imported inside the hooks that need them, as a vendor plugin would import its SDK.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pluggy
import psutil
import torch

from tokenmill.platforms.interfaces import (
    Allocator,
    AllocatorPurpose,
    AttentionBackend,
    AttentionKind,
    Capabilities,
    Communicator,
    DetectionResult,
    HardwareSpec,
    MemoryInfo,
    Platform,
)

hookimpl = pluggy.HookimplMarker("tokenmill")

CAPABILITIES = Capabilities(
    attention_kinds=frozenset(
        {AttentionKind.FULL, AttentionKind.SLIDING_WINDOW, AttentionKind.LINEAR,
         AttentionKind.MLA}
    ),
    dtypes=frozenset({torch.float32, torch.bfloat16}),
    block_sizes=frozenset({8, 16, 32, 64, 128}),
    head_sizes=frozenset({32, 64, 80, 96, 128, 256}),
    collectives=True,
    sleep_mode=True,  # host memory: allocator.py
    # FP8 KV caches (attention.py, mla.py: written quantized, read dequantized)
    kv_cache_dtypes=frozenset({torch.float8_e4m3fn, torch.float8_e5m2}),
)


def memory_info() -> MemoryInfo:
    memory = psutil.virtual_memory()
    return MemoryInfo(total_bytes=memory.total, free_bytes=memory.available)


@hookimpl
def tokenmill_api_version() -> str:
    # the plugin API this plugin was written against (1.1: apply_token_bitmask; 1.3: a
    # LINEAR backend over recurrent state:
    # gated_delta and kda, and mamba2 on its own backend; 1.4: its hardware table; 1.7:
    # FP8 KV caches, Capabilities.kv_cache_dtypes; 1.8: prepack_quantized_linear)
    return "1.8"


@hookimpl
def tokenmill_detect() -> DetectionResult:
    from tokenmill_cpu.hardware import usable_cores

    capability = torch.backends.cpu.get_cpu_capability()
    return DetectionResult(True, f"{usable_cores()} usable cores, {capability} kernels")


@hookimpl
def tokenmill_platform() -> Platform:
    from tokenmill_cpu.hardware import cpu_flags, has_native_bf16

    default_dtype = torch.bfloat16 if has_native_bf16(cpu_flags()) else torch.float32
    return Platform(
        name="cpu",
        device_type="cpu",
        capabilities=CAPABILITIES,
        default_dtype=default_dtype,
        memory_info=memory_info,
        version=f"torch {torch.__version__}",
        # 512 prompt tokens are about 0.45 s of prefill on 2 cores (SmolLM2-135M, bf16); a
        # long prompt taking a whole 2048-token step made every turn arriving meanwhile wait
        # up to ~1.8 s (docs/benchmarks-peers.md, agent replay).
        long_prefill_token_threshold=512,
    )


@hookimpl
def tokenmill_attention_backends(platform: Platform) -> list[AttentionBackend]:
    from tokenmill_cpu.attention import CpuPagedAttention
    from tokenmill_cpu.linear_attention import CpuLinearAttention
    from tokenmill_cpu.mamba2 import CpuMamba2Attention
    from tokenmill_cpu.mla import CpuMLAAttention

    return [
        CpuPagedAttention(AttentionKind.FULL),
        CpuPagedAttention(AttentionKind.SLIDING_WINDOW),
        # before cpu_linear, which runs every reference variant (mamba2 on the reference)
        CpuMamba2Attention(),
        CpuLinearAttention(),
        CpuMLAAttention(),
    ]


@hookimpl
def tokenmill_communicator(platform: Platform, group: object | None) -> Communicator:
    from tokenmill_cpu.communicator import make_communicator

    return make_communicator(group)


@hookimpl
def tokenmill_allocator(platform: Platform, purpose: AllocatorPurpose) -> Allocator:
    from tokenmill_cpu.allocator import make_allocator

    return make_allocator(purpose)


@hookimpl
def tokenmill_ops(platform: Platform) -> dict[str, Callable]:
    # Each override replaces several small ATen calls with fewer; at batch 1 the step is
    # dominated by per-op overhead besides the matmuls (see docs/benchmarks.md).
    from tokenmill.platforms.ops.quant import ReferenceQuantizedLinear
    from tokenmill_cpu import ops

    overrides = {
        "rms_norm": ops.rms_norm,
        "fused_add_rms_norm": ops.fused_add_rms_norm,
        "rotary_embedding": ops.rotary_embedding,
        "apply_token_bitmask": ops.apply_token_bitmask,
        **ops.kernel_ops(),
    }
    if ops.onednn_linear_available():
        overrides["prepack_linear"] = ops.prepack_linear
    if ops.int4_kernel_available():
        # schemes without a kernel: the reference, logged once per scheme
        fallback = ReferenceQuantizedLinear("platform plugin 'cpu'")
        overrides["prepack_quantized_linear"] = functools.partial(
            ops.prepack_quantized_linear, fallback=fallback)
    return overrides


@hookimpl
def tokenmill_hardware_spec(platform: Platform | None, device: str | None) -> HardwareSpec | None:
    """This machine's CPU (estimated from its cores and ISA; `tokenmill plan --calibrate`
    measures it). Asked by name, the table holds one device: "cpu", this host."""
    from tokenmill_cpu.hardware import estimate_hardware_spec

    if device is not None and device.strip().lower() != "cpu":
        return None
    return estimate_hardware_spec()


@hookimpl
def tokenmill_waivers(platform: Platform) -> list[tuple[str, str]]:
    return []
