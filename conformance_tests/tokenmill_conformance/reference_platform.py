"""The reference platform: the core's reference attention and ops on the CPU.

An ordinary in-process plugin. Tier T3 compares the plugin under test with it, token for
token; it is registered beside the plugin as "tokenmill-reference".
"""

from __future__ import annotations

import pluggy
import torch

from tokenmill.platforms.interfaces import (
    Allocator,
    AllocatorPurpose,
    AttentionBackend,
    AttentionKind,
    Capabilities,
    DetectionResult,
    HardwareSpec,
    MemoryInfo,
    Platform,
)
from tokenmill.platforms.kit.host_allocator import HostAllocator
from tokenmill.platforms.ops.reference import ReferenceAttentionBackend

hookimpl = pluggy.HookimplMarker("tokenmill")

_LIMIT_BYTES = 4 << 30
CAPABILITIES = Capabilities(
    attention_kinds=frozenset({AttentionKind.FULL, AttentionKind.SLIDING_WINDOW}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    block_sizes=frozenset(1 << i for i in range(9)),
    head_sizes=frozenset({32, 64, 80, 96, 128, 256}),
)


def _memory_info() -> MemoryInfo:
    return MemoryInfo(total_bytes=_LIMIT_BYTES, free_bytes=_LIMIT_BYTES)


@hookimpl
def tokenmill_api_version() -> str:
    return "1.3"


@hookimpl
def tokenmill_detect() -> DetectionResult:
    return DetectionResult(True, "the core's reference ops on the CPU")


@hookimpl
def tokenmill_platform() -> Platform:
    return Platform(
        name="tokenmill-reference",
        device_type="cpu",
        capabilities=CAPABILITIES,
        default_dtype=torch.float32,
        memory_info=_memory_info,
    )


@hookimpl
def tokenmill_attention_backends(platform: Platform) -> list[AttentionBackend]:
    full = ReferenceAttentionBackend()
    sliding = ReferenceAttentionBackend()
    sliding.kind = AttentionKind.SLIDING_WINDOW
    sliding.name = "reference_sliding_window"
    return [full, sliding]


@hookimpl
def tokenmill_allocator(platform: Platform, purpose: AllocatorPurpose) -> Allocator:
    return HostAllocator(purpose, _LIMIT_BYTES, "the reference platform's fixed limit", owner="reference")


@hookimpl
def tokenmill_hardware_spec(platform: Platform) -> HardwareSpec:
    # ceilings no host CPU reaches (a PFLOP/s, 2 TB/s): T5 holds measurements to them
    return HardwareSpec(
        name="reference (nominal ceilings)",
        peak_flops={"float32": 1e15, "bfloat16": 1e15, "float16": 1e15},
        memory_bandwidth=2e12,
        memory_bytes=_LIMIT_BYTES,
    )
