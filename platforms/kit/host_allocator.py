"""A host-memory allocator a plugin can use as it is, or build on.

Every plugin whose KV arena, weights or staging buffers are host memory (the cpu plugin;
the tpu plugin, whose torch side is the host; a GPU plugin's host staging) needs the same
accounting: a limit fixed at creation, exact bytes in use, an `OutOfMemoryError` that
says how much was asked, how much is free and where the limit came from, a `ValueError`
for a buffer freed twice, and sleep mode. Conformance tiers T0 and T1 check all of it.
"""

from __future__ import annotations

import os

import torch

from tokenmill.platforms.interfaces import Allocator, AllocatorPurpose, OutOfMemoryError
from tokenmill.platforms.sleep import BufferSleep

GIB = 1 << 30


class HostAllocator(Allocator):
    """uint8 host tensors up to a fixed byte limit, with exact in-use accounting and sleep
    mode (every live buffer's memory freed and given back; `BufferSleep`).

    `owner` names the plugin in every error; `limit_source` says where the limit came from
    and `limit_hint` how to change it (both shown when an allocation does not fit)."""

    def __init__(self, purpose: AllocatorPurpose, limit_bytes: int, limit_source: str,
                 owner: str, limit_hint: str = "") -> None:
        if limit_bytes <= 0:
            raise ValueError(f"{purpose.value} limit must be positive, got {limit_bytes} bytes")
        self.purpose = purpose
        self.owner = owner
        self._limit = limit_bytes
        self._limit_source = limit_source
        self._limit_hint = limit_hint
        self._live: dict[int, torch.Tensor] = {}  # storage address -> buffer
        self._in_use = 0
        self._sleep = BufferSleep(f"{owner} {purpose.value} allocator")

    def allocate(self, num_bytes: int) -> torch.Tensor:
        """A fresh uint8 tensor of `num_bytes` (> 0) bytes; `OutOfMemoryError` past the limit."""
        if num_bytes <= 0:
            raise ValueError(
                f"{self.owner} {self.purpose.value} allocator: num_bytes={num_bytes} must be > 0"
            )
        if self._sleep.sleeping:
            raise RuntimeError(f"{self.owner} {self.purpose.value} allocator is asleep; wake() it first")
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
                f"{self.owner} {self.purpose.value} allocator: buffer at {buffer.data_ptr():#x} "
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
        hint = f"; {self._limit_hint}" if self._limit_hint else ""
        return (
            f"{self.owner} {self.purpose.value} allocator cannot allocate {num_bytes} bytes "
            f"({num_bytes / GIB:.2f} GiB): {free} bytes ({free / GIB:.2f} GiB) free of its "
            f"{self._limit}-byte limit ({self._limit_source}){hint}"
        )


def gib_from_env(variable: str) -> tuple[int, str] | None:
    """(bytes, where they came from) when `$variable` holds a positive number of GiB
    ("4", "0.5"), None when it is unset; ValueError naming it when it is anything else.
    The plugins' KV-arena size variables (`TOKENMILL_CPU_KVCACHE_GIB`, ...)."""
    text = os.environ.get(variable)
    if not text:
        return None
    try:
        gib = float(text)
    except ValueError:
        gib = -1.0
    if gib <= 0:
        raise ValueError(f"${variable}={text!r} must be a positive number of GiB, e.g. 4")
    return int(gib * GIB), f"${variable}={text}"
