"""Device allocators of the GPU plugins, with sleep mode.

Each buffer is one `torch.empty` through torch's caching allocator (the KV arena is one
allocation of the arena's size). Sleep mode, as vLLM's: `sleep()` frees the device memory
of every live buffer while the buffer tensors, and every view the engine holds of them,
stay valid objects (`tokenmill.platforms.sleep.BufferSleep`): the storage is resized to
0 bytes (weights are first copied to host memory at level 1; the KV arena's contents are
discarded). `wake()` resizes the storages back and restores what was kept (the rest comes
back zeroed). Views follow their storage, so the
engine's per-layer caches need no rebuilding; device addresses do change, so captured
graphs must be captured again after a wake.

The vendor specifics (which device, how limits are set, how cached blocks go back to the
driver) come from the plugin as arguments.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.platforms.interfaces import Allocator, AllocatorPurpose, OutOfMemoryError
from tokenmill.platforms.sleep import BufferSleep

GIB = 1 << 30


class DeviceAllocator(Allocator):
    """uint8 buffers on `device` up to a fixed byte limit, exact accounting, sleep / wake.

    `release_cached`: called after sleep frees storages, to return the caching allocator's
    now idle blocks to the driver (torch.cuda.empty_cache on a GPU; nothing on the CPU)."""

    def __init__(
        self,
        purpose: AllocatorPurpose,
        device: torch.device,
        limit_bytes: int,
        limit_source: str,
        platform_name: str,
        pin_memory: bool = False,
        release_cached: Callable[[], None] = lambda: None,
    ) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"{purpose.value} limit must be positive, got {limit_bytes} bytes")
        self.purpose = purpose
        self.device = device
        self._limit = limit_bytes
        self._limit_source = limit_source
        self._platform = platform_name
        self._pin = pin_memory
        self._release_cached = release_cached
        self._live: dict[int, torch.Tensor] = {}  # id(buffer) -> buffer (kept alive here)
        self._in_use = 0
        self._sleep = BufferSleep(self._what())

    # ---- Allocator -------------------------------------------------------------------
    def allocate(self, num_bytes: int) -> torch.Tensor:
        """A fresh uint8 tensor of `num_bytes` (> 0) bytes; `OutOfMemoryError` past the
        limit or when the device refuses; an error while asleep."""
        if num_bytes <= 0:
            raise ValueError(f"{self._what()}: num_bytes={num_bytes} must be > 0")
        if self.sleeping:
            raise RuntimeError(f"{self._what()} is asleep; wake() it before allocating")
        free = self._limit - self._in_use
        if num_bytes > free:
            raise OutOfMemoryError(self._oom_message(num_bytes, free))
        try:
            buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self.device,
                                 pin_memory=self._pin)
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # the device refused
            raise OutOfMemoryError(self._oom_message(num_bytes, free) + f" ({exc})") from exc
        self._live[id(buffer)] = buffer
        self._in_use += num_bytes
        return buffer

    def free(self, buffer: torch.Tensor) -> None:
        """Stop accounting `buffer` (it is freed when the caller drops it); `ValueError` if
        it is not live here (a double free)."""
        key = id(buffer) if self._live.get(id(buffer)) is buffer else None
        if key is None and not self.sleeping:  # another tensor object over the same bytes
            key = next((k for k, b in self._live.items() if b.data_ptr() == buffer.data_ptr()
                        and b.numel() == buffer.numel()), None)
        if key is None:
            raise ValueError(
                f"{self._what()}: buffer of {buffer.numel()} bytes was already freed or was not "
                "allocated here; free each buffer returned by allocate() exactly once"
            )
        self._in_use -= self._live.pop(key).numel()

    def bytes_in_use(self) -> int:
        return self._in_use

    def bytes_limit(self) -> int:
        return self._limit

    # ---- sleep mode ------------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        return self._sleep.sleeping

    def sleep(self, keep_contents: bool | None = None) -> int:
        """Free the device memory of every live buffer; returns the bytes freed. Contents
        are kept in host memory with `keep_contents` (default: weights yes, the KV arena
        no), and the caching allocator's idle blocks go back to the driver. Sleeping twice
        is an error."""
        if keep_contents is None:
            keep_contents = self.purpose is AllocatorPurpose.WEIGHTS
        return self._sleep.sleep(self._live.items(), keep_contents, self._release_cached)

    def wake(self) -> None:
        """Give every buffer its memory back (same tensors and views, new addresses):
        kept contents restored, the rest zeroed. Waking an awake allocator is an error."""
        self._sleep.wake(self._live.items())

    # ---- messages --------------------------------------------------------------------
    def _what(self) -> str:
        return f"{self._platform} {self.purpose.value} allocator"

    def _oom_message(self, num_bytes: int, free: int) -> str:
        return (
            f"{self._what()} cannot allocate {num_bytes} bytes ({num_bytes / GIB:.2f} GiB): "
            f"{free} bytes ({free / GIB:.2f} GiB) free of its {self._limit}-byte limit "
            f"({self._limit_source})"
        )


def make_device_allocator(
    purpose: AllocatorPurpose,
    interpreter: bool,
    platform_name: str,
    kvcache_env: str,
    gpu_fractions: dict[AllocatorPurpose, float],
    host_fractions: dict[AllocatorPurpose, float],
) -> DeviceAllocator:
    """A plugin's allocator for `purpose`, its limit read now.

    On a GPU (torch's "cuda" device, HIP included): the KV arena and weights on the current
    device, limited to `gpu_fractions[purpose]` of the free (KV arena) or total (weights)
    memory, cached blocks returned to the driver on sleep; host staging pinned. In
    interpreter mode everything is on the CPU, limited by `host_fractions` of the
    available host memory. `$kvcache_env` GiB, when set, is the KV arena's limit."""
    import os

    import psutil

    if interpreter or purpose is AllocatorPurpose.HOST_STAGING:
        available = psutil.virtual_memory().available
        fraction = host_fractions[purpose]
        limit = int(fraction * available)
        source = f"{fraction:.0%} of {available / GIB:.1f} GiB host memory available"
        device, pin, release = torch.device("cpu"), not interpreter, _nothing
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        free, total = torch.cuda.mem_get_info(device)
        fraction = gpu_fractions[purpose]
        base, which = (free, "free") if purpose is AllocatorPurpose.KV_ARENA else (total, "total")
        limit = int(fraction * base)
        source = f"{fraction:.0%} of {base / GIB:.1f} GiB device memory {which}"
        pin, release = False, torch.cuda.empty_cache
    if purpose is AllocatorPurpose.KV_ARENA and os.environ.get(kvcache_env):
        text = os.environ[kvcache_env]
        try:
            gib = float(text)
        except ValueError:
            gib = -1.0
        if gib <= 0:
            raise ValueError(f"${kvcache_env}={text!r} must be a positive number of GiB, e.g. 40")
        limit, source = int(gib * GIB), f"${kvcache_env}={text}"
    return DeviceAllocator(purpose, device, limit, source, platform_name, pin_memory=pin,
                           release_cached=release)


def _nothing() -> None:
    return None
