"""Allocators for the memory the core asks this platform for.

The core's KV arena, weights and staging buffers are torch tensors. On JAX's CPU backend
device memory is host memory, so each purpose gets host uint8 tensors up to a limit fixed
at creation: `$TOKENMILL_TPU_KVCACHE_GIB` GiB for the KV arena, else 30% of the memory
psutil reports available; weights 60%; host staging 10%. (On a TPU, the plugin's runner
keeps its KV and weights in HBM as JAX arrays sized from the same limits; what this
allocator hands out stays on the host.)
"""

from __future__ import annotations

import psutil

from tokenmill.platforms.interfaces import AllocatorPurpose
from tokenmill.platforms.kit.host_allocator import HostAllocator, gib_from_env

KVCACHE_ENV = "TOKENMILL_TPU_KVCACHE_GIB"
GIB = 1 << 30
_FRACTION = {
    AllocatorPurpose.KV_ARENA: 0.3,
    AllocatorPurpose.WEIGHTS: 0.6,
    AllocatorPurpose.HOST_STAGING: 0.1,
}


def make_allocator(purpose: AllocatorPurpose) -> HostAllocator:
    """The allocator for `purpose`, its limit read from the environment and psutil now."""
    hint = f"set ${KVCACHE_ENV} to change it" if purpose is AllocatorPurpose.KV_ARENA else ""
    fixed = gib_from_env(KVCACHE_ENV) if purpose is AllocatorPurpose.KV_ARENA else None
    if fixed is None:
        available = psutil.virtual_memory().available
        fraction = _FRACTION[purpose]
        fixed = int(fraction * available), f"{fraction:.0%} of {available / GIB:.1f} GiB available"
    return HostAllocator(purpose, *fixed, owner="tpu", limit_hint=hint)
