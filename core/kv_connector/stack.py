"""Tiers stacked fastest first (host, disk, remote): lookups, checked reads, saves.

Two roles. The host tier (`host`, host.py), if any, is the device pool's victim cache:
it holds what the device evicted (the worker moves it there, `KVConnectorWorker`), and a
load from it moves the block back to the device, so device and host hold different
blocks and their capacities add. The tiers below it (`durable`: disk, remote) are
write-through: every block is saved to them as it fills, so it survives the loss of the
device, the host or any one of them, and an idle session's history is written down
before anything evicts it.

- `put` writes an object to every reachable durable tier that lacks it.
- `get` reads from the fastest tier that holds the key, checks the object with the
  stack's `ObjectCodec` (objects.py: framing, the layout's payload size, checksum, and
  the MAC tag of an object read from a shared tier when a MAC key is set) and copies it
  up into the faster durable tiers that lack it (a remote hit lands on disk too; never
  into the host: what is read goes to the device). An object that fails any check is
  deleted from its tier and counted corrupt, and the next tier is tried: a read returns
  the right bytes or nothing, never wrong ones, and never raises for what a tier held.
- `promote` copies an object into the host tier (a prefetch for a queued request).
- A tier that raises `TierUnavailableError` is skipped for that call; the others carry
  on.

The stack keeps every tier's counters (`TierStats`), which the metrics export. With
`record_changes()` it also logs every object a tier gains or loses (`take_changes`), for
an engine that mirrors it from another process (directory.py).
"""

from __future__ import annotations

import copy
import logging
import threading

from tokenmill.kv_connector.host import HostMemoryTier
from tokenmill.kv_connector.objects import CorruptObjectError, ObjectCodec, ObjectKey
from tokenmill.platforms.kv_messages import TierChange, TierIndex
from tokenmill.platforms.kv_tier import KVTier, TierStats, TierUnavailableError

logger = logging.getLogger(__name__)


class TierStack:
    """`codec`: frames and checks the objects of the engine's layout (every read)."""

    def __init__(self, tiers: list[KVTier], codec: ObjectCodec) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"KV tiers {names}: each tier may appear once")
        self.tiers = tiers
        self.codec = codec
        hosts = [t for t in tiers if isinstance(t, HostMemoryTier)]
        if hosts and tiers[0] is not hosts[0] or len(hosts) > 1:
            raise ValueError(f"KV tiers {names}: one host tier at most, first")
        self.host: HostMemoryTier | None = hosts[0] if hosts else None
        self.durable: list[KVTier] = [t for t in tiers if t is not self.host]
        self.stats: dict[str, TierStats] = {t.name: TierStats() for t in tiers}
        self._lock = threading.Lock()  # guards the counters and the change log
        self._changes: list[TierChange] | None = None  # None: not recording

    # ---- a mirror in another process ---------------------------------------------------
    def record_changes(self) -> None:
        """From now on, log every object each tier gains or loses (`take_changes`)."""
        self._changes = []
        for tier in self.tiers:
            tier.removal_listener = lambda key, name=tier.name: self._log(name, key, False)

    def _log(self, tier_name: str, key: ObjectKey, held: bool) -> None:
        if self._changes is not None:
            with self._lock:
                self._changes.append(TierChange(tier_name, key, held))

    def take_changes(self) -> list[TierChange]:
        """The changes logged since the last call, in order (empty when not recording)."""
        with self._lock:
            if self._changes is None:
                return []
            out, self._changes = self._changes, []
        return out

    def snapshot(self) -> dict[str, TierStats]:
        """A copy of every tier's counters, in stack order."""
        with self._lock:
            return {name: copy.copy(stats) for name, stats in self.stats.items()}

    def index(self, fingerprint: bytes, block_size: int) -> TierIndex:
        """Every key each reachable tier holds now (an unreachable one: none)."""
        keys = []
        for tier in self.tiers:
            try:
                keys.append(tier.keys())
            except TierUnavailableError:
                self._count(tier, errors=1)
                keys.append([])
        return TierIndex(fingerprint, block_size, [t.name for t in self.tiers], keys,
                         self.snapshot(), self.object_bytes, self.host_objects)

    @property
    def host_name(self) -> str | None:
        return None if self.host is None else self.host.name

    @property
    def host_objects(self) -> int:
        """How many objects the host tier holds at most (0: no host tier)."""
        return 0 if self.host is None else self.host.capacity_bytes // self.codec.object_bytes

    @property
    def object_bytes(self) -> int:
        return self.codec.object_bytes

    @property
    def save_tier(self) -> str | None:
        """The first durable tier: where a save in flight lands first (None: none)."""
        return self.durable[0].name if self.durable else None

    def durable_holds(self, key: ObjectKey) -> bool:
        """Whether the first durable tier holds `key` (then a save of it is skipped)."""
        return bool(self.durable) and self._holds(self.durable[0], key)

    def _count(self, tier: KVTier, **deltas: int) -> None:
        self.count(tier.name, **deltas)

    def count(self, tier_name: str, **deltas: int) -> None:
        """Add `deltas` to the named tier's counters (the connector counts tokens here)."""
        with self._lock:
            s = self.stats[tier_name]
            for name, delta in deltas.items():
                setattr(s, name, getattr(s, name) + delta)

    def locate(self, keys: list[ObjectKey]) -> list[str | None]:
        """For each key, the name of the fastest reachable tier holding it (None: none)."""
        where: list[str | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for tier in self.tiers:
            if not todo:
                break
            try:
                held = tier.contains_many([keys[i] for i in todo])
            except TierUnavailableError:
                self._count(tier, errors=1)
                continue
            for i, h in zip(todo, held):
                if h:
                    where[i] = tier.name
            todo = [i for i, h in zip(todo, held) if not h]
        return where

    def num_leading_hits(self, keys: list[ObjectKey]) -> int:
        """How many of `keys`, from the first, some reachable tier holds."""
        n = 0
        for name in self.locate(keys):
            if name is None:
                break
            n += 1
        return n

    def contains(self, key: ObjectKey) -> bool:
        return self.locate([key])[0] is not None

    def get(self, key: ObjectKey) -> tuple[memoryview, str] | None:
        """The checked payload of `key` and the tier it came from, or None."""
        for i, tier in enumerate(self.tiers):
            try:
                data = tier.get(key)
            except TierUnavailableError:
                self._count(tier, errors=1)
                continue
            if data is None:
                self._count(tier, misses=1)
                continue
            payload = self.checked(tier, key, data)
            if payload is None:
                continue
            self._count(tier, hits=1, bytes_read=len(data))
            self.promote_durable(key, data, [t for t in self.tiers[:i] if t is not self.host])
            return payload, tier.name
        return None

    def promote(self, key: ObjectKey) -> bool:
        """Copy `key` into the host tier from the fastest durable tier holding it (a
        prefetch); whether the host holds it now."""
        if self.host is None:
            return False
        if self.host.contains(key):
            return True
        for i, tier in enumerate(self.durable):
            try:
                data = tier.get(key)
            except TierUnavailableError:
                self._count(tier, errors=1)
                continue
            if data is None:
                self._count(tier, misses=1)
                continue
            if self.checked(tier, key, data) is None:
                continue
            self._count(tier, hits=1, bytes_read=len(data))
            self.promote_durable(key, data, self.durable[:i])  # as a read does
            self._write(key, data, [self.host], "bytes_promoted")
            return self.host.contains(key)
        return False

    def checked(self, tier: KVTier, key: ObjectKey, data) -> memoryview | None:
        """The payload of `data`, read from `tier` under `key`, if it passes every check;
        else None, the object deleted from the tier and counted corrupt."""
        try:
            return self.codec.decode(key, data, authenticate=tier.shared)
        except CorruptObjectError as exc:
            self.refuse(tier, key, str(exc))
            return None

    def refuse(self, tier: KVTier, key: ObjectKey, why: str) -> None:
        """An object of `tier` failed a check: count it corrupt and delete it."""
        logger.warning("KV tier %s: object %s: %s; deleted, trying the next tier",
                       tier.name, key.hex()[:16], why)
        self._count(tier, corrupt=1)
        self._delete(tier, key)

    def _holds(self, tier: KVTier, key: ObjectKey) -> bool:
        try:
            return tier.contains(key)
        except TierUnavailableError:
            self._count(tier, errors=1)
            return False

    def put(self, key: ObjectKey, data: bytes) -> list[str]:
        """Save an encoded object to every reachable durable tier lacking it; the tiers
        written."""
        return self._write(key, data, self.durable, "bytes_written")

    def log_held(self, tier_name: str, keys: list[ObjectKey]) -> None:
        """Record objects a tier gained outside `put` (the worker's moves into the host)."""
        for key in keys:
            self._log(tier_name, key, True)

    def promote_durable(self, key: ObjectKey, data: bytes | memoryview, tiers: list[KVTier]) -> None:
        """Copy a checked object read from a slower durable tier into faster `tiers`."""
        if tiers:
            self._write(key, data, tiers, "bytes_promoted")

    def _write(self, key, data, tiers: list[KVTier], counter: str) -> list[str]:
        written = []
        for tier in tiers:
            try:
                if tier.put(key, data):
                    self._count(tier, **{counter: len(data)})
                    self._log(tier.name, key, True)
                    written.append(tier.name)
            except TierUnavailableError:
                self._count(tier, errors=1)
        return written

    def delete(self, tier: KVTier, key: ObjectKey) -> None:
        """Drop `key` from `tier` (a block moved to the device, or a bad object)."""
        self._delete(tier, key)

    def _delete(self, tier: KVTier, key: ObjectKey) -> None:
        try:
            tier.delete(key)
        except TierUnavailableError:
            self._count(tier, errors=1)
        self._log(tier.name, key, False)  # a tier that reports its own removals: twice, harmless

    def tier(self, name: str) -> KVTier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no KV tier named {name!r}; the stack has {[t.name for t in self.tiers]}")

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
