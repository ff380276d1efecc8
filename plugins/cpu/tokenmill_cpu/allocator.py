"""Host-memory allocators for the KV arena, weights and staging buffers.

Limits are fixed when an allocator is created (at activation, never at import):
- KV arena: `$TOKENMILL_CPU_KVCACHE_GIB` GiB, else 40% of the memory psutil reports
  available;
- weights: 90% of available memory;
- host staging: 10% of available memory.
The allocator accounts for what it handed out; `free` stops the accounting and drops the
allocator's reference, and the memory returns to the system when the caller drops its own.
Sleep mode (`LLM.sleep`) frees every live buffer's memory and gives it back on wake
(`tokenmill.platforms.sleep.BufferSleep`): the host path of the same mechanics the GPU
plugins run on device memory.
"""

from __future__ import annotations

import os

import psutil
import torch

from tokenmill.platforms.interfaces import Allocator, AllocatorPurpose, OutOfMemoryError
from tokenmill.platforms.sleep import BufferSleep

KVCACHE_ENV = "TOKENMILL_CPU_KVCACHE_GIB"
GIB = 1 << 30
_AVAILABLE_FRACTION = {
    AllocatorPurpose.KV_ARENA: 0.4,
    AllocatorPurpose.WEIGHTS: 0.9,
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
        self._live: dict[int, torch.Tensor] = {}  # storage address -> buffer
        self._in_use = 0
        self._sleep = BufferSleep(f"cpu {purpose.value} allocator")

    def allocate(self, num_bytes: int) -> torch.Tensor:
        """A fresh uint8 tensor of `num_bytes` (> 0) bytes; `OutOfMemoryError` past the limit."""
        if num_bytes <= 0:
            raise ValueError(
                f"cpu {self.purpose.value} allocator: num_bytes={num_bytes} must be > 0"
            )
        if self._sleep.sleeping:
            raise RuntimeError(f"cpu {self.purpose.value} allocator is asleep; wake() it first")
        free = self._limit - self._in_use
        if num_bytes > free:
            raise OutOfMemoryError(self._oom_message(num_bytes, free))
        try:
            buffer = torch.empty(num_bytes, dtype=torch.uint8)
        except RuntimeError as exc:  # the system refused although the limit allowed it
            raise OutOfMemoryError(self._oom_message(num_bytes, free) + f" ({exc})") from exc
        self._live[buffer.untyped_storage().data_ptr()] = buffer
        self._in_use += num_bytes
        return buffer

    def free(self, buffer: torch.Tensor) -> None:
        """Stop accounting `buffer`; raises `ValueError` if it is not live here (double free)."""
        address = buffer.untyped_storage().data_ptr()
        live = self._live.get(address)
        if live is None or live.data_ptr() != buffer.data_ptr() or live.numel() != buffer.numel():
            raise ValueError(
                f"cpu {self.purpose.value} allocator: buffer at {buffer.data_ptr():#x} "
                f"({buffer.numel()} bytes) was already freed or was not allocated by this "
                "allocator; free each buffer returned by allocate() exactly once"
            )
        del self._live[address]
        self._in_use -= live.numel()

    def bytes_in_use(self) -> int:
        return self._in_use

    def bytes_limit(self) -> int:
        return self._limit

    @property
    def sleeping(self) -> bool:
        return self._sleep.sleeping

    def sleep(self, keep_contents: bool) -> int:
        """See `Allocator.sleep`: every live buffer's memory goes back to the system (a
        copy kept first with `keep_contents`); returns the bytes freed."""
        return self._sleep.sleep(self._live.items(), keep_contents)

    def wake(self) -> None:
        """See `Allocator.wake`; buffers are keyed again by their new addresses."""
        self._sleep.wake(self._live.items())
        self._live = {b.untyped_storage().data_ptr(): b for b in self._live.values()}

    def _oom_message(self, num_bytes: int, free: int) -> str:
        hint = (
            f"; set ${KVCACHE_ENV} to change it"
            if self.purpose is AllocatorPurpose.KV_ARENA
            else ""
        )
        return (
            f"cpu {self.purpose.value} allocator cannot allocate {num_bytes} bytes "
            f"({num_bytes / GIB:.2f} GiB): {free} bytes ({free / GIB:.2f} GiB) free of its "
            f"{self._limit}-byte limit ({self._limit_source}){hint}"
        )


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
    fraction = _AVAILABLE_FRACTION[purpose]
    available = psutil.virtual_memory().available
    source = f"{fraction:.0%} of {available / GIB:.1f} GiB available"
    return HostAllocator(purpose, int(fraction * available), source)
