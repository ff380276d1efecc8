"""Host memory tier: one slab from the platform's host-staging allocator, in fixed slots.

Every object of one layout has the same size, so the slab is cut into slots of
`object_bytes` and a key maps to a slot; no fragmentation, no per-object allocation.
The slab comes from `AllocatorPurpose.HOST_STAGING`: on a device platform that is pinned
host memory (the plugin's business), so copies to and from the device run at full
link speed; on the CPU platform it is plain memory.

Its place in the stack (stack.py): the device pool's victim cache. A block the device
evicts moves here (`reserve` + `seal`, written by the worker straight from the arena);
a block loaded from here moves to the device (the worker deletes it after the load).
So the device and the host hold different blocks and their capacities add.

Eviction: by benefit, as the device pool's (core/kv/block_pool.py): GreedyDual-Size
over the recompute a block saves per byte, which it brings from the device
(`KVBlock.benefit`); every object is the same bytes, so the lowest `clock + benefit`
goes first, and the clock (the priority of the last eviction) ages what stays. Objects
copied in without a benefit (prefetches, `put`) get the mean benefit of what is held.
Pinned objects (`pin`: what loads and queued requests are about to read) are never
evicted; a delete of a pinned one waits for its last unpin.
"""

from __future__ import annotations

import heapq
import itertools
import threading

import torch

from tokenmill.kv_connector.objects import ObjectKey
from tokenmill.platforms.interfaces import Allocator
from tokenmill.platforms.kv_tier import KVTier


class HostMemoryTier(KVTier):
    name = "host"
    shared = False  # this process's own memory

    def __init__(self, allocator: Allocator, capacity_bytes: int, object_bytes: int) -> None:
        num_slots = capacity_bytes // object_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_offload_host_bytes={capacity_bytes} holds no KV object of "
                f"{object_bytes} bytes; give the host tier at least that much"
            )
        self._allocator = allocator
        self._object_bytes = object_bytes
        self._buffer: torch.Tensor | None = allocator.allocate(num_slots * object_bytes)
        self._slab: torch.Tensor | None = self._buffer.view(num_slots, object_bytes)
        self._slots: dict[ObjectKey, int] = {}  # key -> slot, insertion order
        self._priority: dict[ObjectKey, tuple[float, int]] = {}  # key -> (priority, tick)
        self._heap: list[tuple[float, int, ObjectKey]] = []  # lazy deletion by tick
        self._ticks = itertools.count()
        self._pins: dict[ObjectKey, int] = {}
        self._doomed: set[ObjectKey] = set()  # deleted while pinned: dropped at last unpin
        self._reserved: dict[int, tuple[ObjectKey, float]] = {}  # slot -> (key, benefit)
        self._reserved_keys: set[ObjectKey] = set()
        self._free = list(range(num_slots - 1, -1, -1))
        self._num_slots = num_slots
        self._benefit_sum = 0.0
        self._benefits: dict[ObjectKey, float] = {}
        self.clock = 0.0
        self._lock = threading.Lock()
        self.num_evicted = 0  # objects dropped to make room

    @property
    def slab(self) -> torch.Tensor:
        """The slots as a uint8 tensor [num_slots, object_bytes] (the worker reads and
        writes objects there in place)."""
        if self._slab is None:
            raise RuntimeError("the host tier is closed")
        return self._slab

    @property
    def capacity_bytes(self) -> int:
        return self._num_slots * self._object_bytes

    def used_bytes(self) -> int:
        return len(self._slots) * self._object_bytes

    def contains(self, key: ObjectKey) -> bool:
        return key in self._slots and key not in self._doomed

    def slot_of(self, key: ObjectKey) -> int | None:
        """The slot holding `key` (None: not held). Pin it first if the slot is read
        after the call: an unpinned slot may be reused by the next insertion."""
        with self._lock:
            return None if key in self._doomed else self._slots.get(key)

    def get(self, key: ObjectKey) -> bytes | None:
        with self._lock:
            slot = None if key in self._doomed else self._slots.get(key)
            if slot is None:
                return None
            return self.slab[slot].numpy().tobytes()  # a copy: the slot may be reused

    # ---- insertion ------------------------------------------------------------------
    def put(self, key: ObjectKey, data: bytes | memoryview, benefit: float | None = None) -> bool:
        if len(data) != self._object_bytes:
            raise ValueError(
                f"host tier holds {self._object_bytes}-byte objects; got {len(data)} bytes"
            )
        (slot,) = self.reserve([key], [benefit])
        if slot is None:
            return False
        self.slab[slot].numpy()[:] = memoryview(data).cast("B")
        self.seal([key], [slot])
        return True

    def reserve(self, keys: list[ObjectKey], benefits: list[float | None]) -> list[int | None]:
        """A free slot for each key, evicting the lowest-priority unpinned objects; None
        where the key is held already or nothing unpinned is left to evict. The caller
        writes each object into `slab[slot]`, then `seal`s them (until then the keys are
        not held); a reserved slot is the caller's alone."""
        out: list[int | None] = []
        with self._lock:
            for key, benefit in zip(keys, benefits, strict=True):
                if key in self._slots or key in self._reserved_keys:
                    out.append(None)
                    continue
                if not self._free and not self._evict_one():
                    out.append(None)
                    continue
                slot = self._free.pop()
                self._reserved[slot] = (key, self._mean_benefit() if benefit is None else benefit)
                self._reserved_keys.add(key)
                out.append(slot)
        return out

    def seal(self, keys: list[ObjectKey], slots: list[int]) -> None:
        """The objects written into reserved `slots` are whole: `keys` are held from now."""
        with self._lock:
            for key, slot in zip(keys, slots, strict=True):
                reserved_key, benefit = self._reserved.pop(slot)
                self._reserved_keys.discard(reserved_key)
                if reserved_key != key:
                    raise ValueError(f"slot {slot} was reserved for another key")
                self._slots[key] = slot
                self._benefits[key] = benefit
                self._benefit_sum += benefit
                self._push(key, self.clock + benefit)

    def release(self, slots: list[int]) -> None:
        """Give back reserved slots that were not written (nothing to seal)."""
        with self._lock:
            for slot in slots:
                key, _ = self._reserved.pop(slot)
                self._reserved_keys.discard(key)
                self._free.append(slot)

    def _mean_benefit(self) -> float:
        return self._benefit_sum / len(self._benefits) if self._benefits else 0.0

    def _push(self, key: ObjectKey, priority: float) -> None:
        tick = next(self._ticks)
        self._priority[key] = (priority, tick)
        heapq.heappush(self._heap, (priority, tick, key))
        if len(self._heap) > 2 * len(self._priority) + 64:  # drop the dead entries
            self._heap = [e for e in self._heap if self._priority.get(e[2], (0, -1))[1] == e[1]]
            heapq.heapify(self._heap)

    def _evict_one(self) -> bool:
        """Drop the lowest-priority unpinned object (under the lock). False: none."""
        skipped = []
        found = False
        while self._heap:
            priority, tick, key = heapq.heappop(self._heap)
            if self._priority.get(key, (0, -1))[1] != tick:
                continue  # dead entry
            if self._pins.get(key):
                skipped.append((priority, tick, key))
                continue
            self.clock = max(self.clock, priority)
            self._drop(key)
            self.num_evicted += 1
            found = True
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

    def _drop(self, key: ObjectKey) -> None:
        """Free `key`'s slot; reported removed unless it was when doomed."""
        slot = self._slots.pop(key)
        self._priority.pop(key, None)
        self._benefit_sum -= self._benefits.pop(key, 0.0)
        self._free.append(slot)
        if key in self._doomed:
            self._doomed.discard(key)
        else:
            self._removed(key)

    # ---- pins and deletion ------------------------------------------------------------
    def pin(self, keys: list[ObjectKey]) -> None:
        """Keep `keys` (held or not yet) from eviction until as many `unpin`s."""
        with self._lock:
            for key in keys:
                self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                n = self._pins.get(key, 0) - 1
                if n > 0:
                    self._pins[key] = n
                    continue
                self._pins.pop(key, None)
                if key in self._doomed:
                    self._drop(key)

    def delete(self, key: ObjectKey) -> None:
        """Drop `key`: now, or at its last unpin if pinned (it reads as absent at once)."""
        with self._lock:
            if key not in self._slots:
                return
            if self._pins.get(key):
                if key not in self._doomed:
                    self._doomed.add(key)
                    self._removed(key)
                return
            self._drop(key)

    def keys(self) -> list[ObjectKey]:
        """Held keys, lowest priority (first to go) first."""
        with self._lock:
            live = [k for k in self._slots if k not in self._doomed]
            return sorted(live, key=lambda k: self._priority[k])

    def slot_view(self, key: ObjectKey) -> torch.Tensor:
        """The live bytes of `key`'s slot (for tests that corrupt an object in place)."""
        return self.slab[self._slots[key]]

    def close(self) -> None:
        with self._lock:
            if self._buffer is not None:
                self._allocator.free(self._buffer)
                self._buffer = self._slab = None
                self._slots.clear()
