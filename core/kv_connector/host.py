"""Host memory tier: one slab from the platform's host-staging allocator, in fixed slots.

Every object of one layout has the same size, so the slab is cut into slots of
`object_bytes` and a key maps to a slot; no fragmentation, no per-object allocation.
The slab comes from `AllocatorPurpose.HOST_STAGING`: on a device platform that is pinned
host memory (the plugin's business), so copies to and from the device run at full
link speed; on the CPU platform it is plain memory. Eviction: least recently used.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from tokenmill.kv_connector.objects import ObjectKey
from tokenmill.kv_connector.tier import KVTier
from tokenmill.platforms.interfaces import Allocator


class HostMemoryTier(KVTier):
    name = "host"

    def __init__(self, allocator: Allocator, capacity_bytes: int, object_bytes: int) -> None:
        num_slots = capacity_bytes // object_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_offload_host_bytes={capacity_bytes} holds no KV object of "
                f"{object_bytes} bytes; give the host tier at least that much"
            )
        self._allocator = allocator
        self._object_bytes = object_bytes
        self._slab: torch.Tensor | None = allocator.allocate(num_slots * object_bytes)
        self._slots: OrderedDict[ObjectKey, int] = OrderedDict()  # LRU first
        self._free = list(range(num_slots - 1, -1, -1))
        self._num_slots = num_slots
        self._lock = threading.Lock()
        self.num_evicted = 0  # objects dropped to make room

    @property
    def capacity_bytes(self) -> int:
        return self._num_slots * self._object_bytes

    def used_bytes(self) -> int:
        return len(self._slots) * self._object_bytes

    def contains(self, key: ObjectKey) -> bool:
        return key in self._slots

    def get(self, key: ObjectKey) -> bytes | None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return None
            self._slots.move_to_end(key)
            data = self._slot(slot).numpy().tobytes()  # a copy: the slot may be reused
            return data

    def put(self, key: ObjectKey, data: bytes | memoryview) -> bool:
        if len(data) != self._object_bytes:
            raise ValueError(
                f"host tier holds {self._object_bytes}-byte objects; got {len(data)} bytes"
            )
        with self._lock:
            if key in self._slots:
                return False
            if not self._free:
                evicted, slot = self._slots.popitem(last=False)
                self._free.append(slot)
                self.num_evicted += 1
                self._removed(evicted)
            slot = self._free.pop()
            self._slot(slot).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
            self._slots[key] = slot
            return True

    def delete(self, key: ObjectKey) -> None:
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is not None:
                self._free.append(slot)
                self._removed(key)

    def keys(self) -> list[ObjectKey]:
        with self._lock:
            return list(self._slots)

    def slot_view(self, key: ObjectKey) -> torch.Tensor:
        """The live bytes of `key`'s slot (for tests that corrupt an object in place)."""
        return self._slot(self._slots[key])

    def close(self) -> None:
        with self._lock:
            if self._slab is not None:
                self._allocator.free(self._slab)
                self._slab = None
                self._slots.clear()

    def _slot(self, slot: int) -> torch.Tensor:
        if self._slab is None:
            raise RuntimeError("the host tier is closed")
        start = slot * self._object_bytes
        return self._slab[start : start + self._object_bytes]
