"""Sleep mode over an allocator's live buffers, the mechanics a plugin's `Allocator.sleep`
and `wake` can build on (the cpu plugin's host allocators and the GPU plugins' device
allocators do).

`sleep` frees the memory of every live buffer while the buffer tensors, and every view
the engine holds of them, stay valid objects: the storage is resized to 0 bytes, after a
copy to host memory when the contents must survive (weights at level 1). `wake` resizes
the storages back, restores the kept contents and zeroes the rest. Views follow their
storage, so the engine's per-layer caches and weight views need no rebuilding; device
addresses do change (captured graphs must be captured again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class BufferSleep:
    """The asleep/awake state of one allocator's buffers."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._backups: dict[int, torch.Tensor] | None = None  # set while asleep

    @property
    def sleeping(self) -> bool:
        return self._backups is not None

    def sleep(
        self,
        buffers: Iterable[tuple[int, torch.Tensor]],
        keep_contents: bool,
        release: Callable[[], None] = lambda: None,
    ) -> int:
        """Free each (key, buffer)'s memory, a host copy first if `keep_contents`; then
        `release()` (e.g. return a caching allocator's idle blocks to the driver). Returns
        the bytes freed. Sleeping twice is an error."""
        if self.sleeping:
            raise RuntimeError(f"{self._what} is already asleep")
        backups: dict[int, torch.Tensor] = {}
        freed = 0
        for key, buffer in buffers:
            storage = buffer.untyped_storage()
            if keep_contents:
                backups[key] = buffer.to("cpu", copy=True)
            freed += storage.nbytes()
            storage.resize_(0)
        self._backups = backups
        release()
        return freed

    def wake(self, buffers: Iterable[tuple[int, torch.Tensor]]) -> None:
        """Give each (key, buffer) its memory back: kept contents restored, others zeroed.
        Waking an awake allocator is an error."""
        if self._backups is None:
            raise RuntimeError(f"{self._what} is not asleep")
        for key, buffer in buffers:
            buffer.untyped_storage().resize_(buffer.numel())
            backup = self._backups.get(key)
            if backup is None:
                buffer.zero_()
            else:
                buffer.copy_(backup)
        self._backups = None
