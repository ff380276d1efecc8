"""Allocators for the memory the core asks this platform for.

The core's KV arena, weights and staging buffers are torch tensors. On JAX's CPU backend
device memory is host memory, so each purpose gets host uint8 tensors up to a limit fixed
at creation: `$TOKENMILL_TPU_KVCACHE_GIB` GiB for the KV arena, else 30% of the memory
psutil reports available; weights 60%; host staging 10%. (On a TPU, the plugin's runner
keeps its KV and weights in HBM as JAX arrays sized from the same limits; what this
allocator hands out stays on the host.)
"""

from __future__ import annotations

import os

import psutil
import torch

from tokenmill.platforms.interfaces import Allocator, AllocatorPurpose, OutOfMemoryError

KVCACHE_ENV = "TOKENMILL_TPU_KVCACHE_GIB"
GIB = 1 << 30
_FRACTION = {
    AllocatorPurpose.KV_ARENA: 0.3,
    AllocatorPurpose.WEIGHTS: 0.6,
    AllocatorPurpose.HOST_STAGING: 0.1,
}


class HostAllocator(Allocator):
    """uint8 host tensors up to a fixed byte limit, with exact in-use accounting."""

    def __init__(self, purpose: AllocatorPurpose, limit_bytes: int, limit_source: str) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"{purpose.value} limit must be positive, got {limit_bytes} bytes")
        self.purpose = purpose
        self._limit = limit_bytes
        self._limit_source = limit_source
        self._live: dict[int, torch.Tensor] = {}  # data pointer -> buffer
        self._in_use = 0

    def allocate(self, num_bytes: int) -> torch.Tensor:
        if num_bytes <= 0:
            raise ValueError(f"tpu {self.purpose.value} allocator: num_bytes={num_bytes} must be > 0")
        free = self._limit - self._in_use
        if num_bytes > free:
            raise OutOfMemoryError(
                f"tpu {self.purpose.value} allocator cannot allocate {num_bytes} bytes: "
                f"{free} of its {self._limit}-byte limit ({self._limit_source}) are free"
            )
        buffer = torch.empty(num_bytes, dtype=torch.uint8)
        self._live[buffer.data_ptr()] = buffer
        self._in_use += num_bytes
        return buffer

    def free(self, buffer: torch.Tensor) -> None:
        """Stop accounting `buffer`; ValueError if it is not live here (e.g. a double free)."""
        live = self._live.get(buffer.data_ptr())
        if live is None or live.numel() != buffer.numel():
            raise ValueError(
                f"tpu {self.purpose.value} allocator: buffer at {buffer.data_ptr():#x} "
                f"({buffer.numel()} bytes) is not live here (freed twice, or not ours)"
            )
        del self._live[buffer.data_ptr()]
        self._in_use -= live.numel()

    def bytes_in_use(self) -> int:
        return self._in_use

    def bytes_limit(self) -> int:
        return self._limit


def make_allocator(purpose: AllocatorPurpose) -> HostAllocator:
    """The allocator for `purpose`, its limit read from the environment and psutil now."""
    if purpose is AllocatorPurpose.KV_ARENA and os.environ.get(KVCACHE_ENV):
        text = os.environ[KVCACHE_ENV]
        try:
            gib = float(text)
        except ValueError:
            gib = -1.0
        if gib <= 0:
            raise ValueError(f"${KVCACHE_ENV}={text!r} must be a positive number of GiB, e.g. 4")
        return HostAllocator(purpose, int(gib * GIB), f"${KVCACHE_ENV}={text}")
    available = psutil.virtual_memory().available
    fraction = _FRACTION[purpose]
    source = f"{fraction:.0%} of {available / GIB:.1f} GiB available"
    return HostAllocator(purpose, int(fraction * available), source)
