"""Host-memory allocators for the KV arena, weights and staging buffers.

Limits are fixed when an allocator is created (at activation, never at import):
- KV arena: `$TOKENMILL_CPU_KVCACHE_GIB` GiB, else 10% of the machine's memory and never
  more than 40% of what psutil reports available: the machine stays usable beside the
  server (24 GiB: 2.4 GiB, about 6,800 blocks of SmolLM2-135M's 16 tokens);
- weights: 90% of available memory;
- host staging (KV offload's host tier and load buffers): the memory available less a
  reserve for the rest of the machine (10% of the total, at most 2 GiB), so the host
  tier is the size the operator asks for unless the machine cannot hold it.
The allocator accounts for what it handed out; `free` stops the accounting and drops the
allocator's reference, and the memory returns to the system when the caller drops its own.
Sleep mode (`LLM.sleep`) frees every live buffer's memory and gives it back on wake
(`tokenmill.platforms.sleep.BufferSleep`): the host path of the same mechanics the GPU
plugins run on device memory.
"""

from __future__ import annotations

import logging

import psutil

from tokenmill.platforms.interfaces import AllocatorPurpose
from tokenmill.platforms.kit.host_allocator import HostAllocator, gib_from_env

KVCACHE_ENV = "TOKENMILL_CPU_KVCACHE_GIB"
GIB = 1 << 30
KV_TOTAL_FRACTION = 0.1  # of the machine's memory: the KV arena's default limit

logger = logging.getLogger(__name__)
_AVAILABLE_FRACTION = {
    AllocatorPurpose.KV_ARENA: 0.4,
    AllocatorPurpose.WEIGHTS: 0.9,
}
HOST_RESERVE_FRACTION = 0.1  # of the total memory, left to the machine by host staging
HOST_RESERVE_MAX = 2 * GIB


def make_allocator(purpose: AllocatorPurpose) -> HostAllocator:
    """The allocator for `purpose`, its limit read from the environment and psutil now."""
    fixed = gib_from_env(KVCACHE_ENV) if purpose is AllocatorPurpose.KV_ARENA else None
    if fixed is not None:
        return _allocator(purpose, *fixed)
    memory = psutil.virtual_memory()
    if purpose is AllocatorPurpose.HOST_STAGING:
        reserve = min(HOST_RESERVE_MAX, int(HOST_RESERVE_FRACTION * memory.total))
        source = (f"the {memory.available / GIB:.1f} GiB available less a {reserve / GIB:.1f} "
                  f"GiB reserve for the machine, of {memory.total / GIB:.1f} GiB")
        return _allocator(purpose, max(1, memory.available - reserve), source)
    fraction = _AVAILABLE_FRACTION[purpose]
    limit, source = int(fraction * memory.available), (
        f"{fraction:.0%} of {memory.available / GIB:.1f} GiB available")
    if purpose is AllocatorPurpose.KV_ARENA and KV_TOTAL_FRACTION * memory.total < limit:
        limit, source = int(KV_TOTAL_FRACTION * memory.total), (
            f"{KV_TOTAL_FRACTION:.0%} of the machine's {memory.total / GIB:.1f} GiB")
    if purpose is AllocatorPurpose.KV_ARENA:
        logger.info("tokenmill-cpu: the KV arena may take %.2f GiB (%s; $%s or "
                    "kv_cache_memory_bytes to change)", limit / GIB, source, KVCACHE_ENV)
    return _allocator(purpose, limit, source)


def _allocator(purpose: AllocatorPurpose, limit: int, source: str) -> HostAllocator:
    hint = f"set ${KVCACHE_ENV} to change it" if purpose is AllocatorPurpose.KV_ARENA else ""
    return HostAllocator(purpose, limit, source, owner="cpu", limit_hint=hint)
