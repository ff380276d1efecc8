"""A plain host-memory allocator with exact accounting, for the reference platform."""

from __future__ import annotations

import torch

from tokenmill.platforms.interfaces import Allocator, AllocatorPurpose, OutOfMemoryError


class HostAllocator(Allocator):
    """uint8 CPU tensors up to `limit_bytes` in total; frees are checked."""

    def __init__(self, purpose: AllocatorPurpose, limit_bytes: int) -> None:
        self.purpose = purpose
        self._limit = limit_bytes
        self._live: dict[int, int] = {}  # data_ptr -> bytes
        self._in_use = 0

    def allocate(self, num_bytes: int) -> torch.Tensor:
        if num_bytes <= 0:
            raise ValueError(f"{self.purpose.value}: num_bytes={num_bytes} must be > 0")
        free = self._limit - self._in_use
        if num_bytes > free:
            raise OutOfMemoryError(
                f"{self.purpose.value} allocator cannot allocate {num_bytes} bytes: {free} of "
                f"its {self._limit}-byte limit are free"
            )
        buffer = torch.empty(num_bytes, dtype=torch.uint8)
        self._live[buffer.data_ptr()] = num_bytes
        self._in_use += num_bytes
        return buffer

    def free(self, buffer: torch.Tensor) -> None:
        num_bytes = self._live.pop(buffer.data_ptr(), None)
        if num_bytes is None or num_bytes != buffer.numel():
            raise ValueError(
                f"{self.purpose.value}: buffer at {buffer.data_ptr():#x} was already freed or "
                "was not allocated here"
            )
        self._in_use -= num_bytes

    def bytes_in_use(self) -> int:
        return self._in_use

    def bytes_limit(self) -> int:
        return self._limit
