"""Tiers stacked fastest first (host, disk, remote): lookups, checked reads, saves.

- `put` writes an object to every reachable tier that lacks it (write-through): a block
  saved once survives the loss of any tier, and a device block with content is already
  on the host when the device evicts it, so eviction never waits for a copy.
- `get` reads from the fastest tier that holds the key, checks the object (objects.py)
  and copies it up into the faster tiers that lack it (promotion). A corrupt object is
  deleted from its tier and the next tier is tried: a read returns the right bytes or
  nothing, never wrong ones.
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

from tokenmill.kv_connector.messages import TierChange, TierIndex
from tokenmill.kv_connector.objects import CorruptObjectError, ObjectKey, decode
from tokenmill.kv_connector.tier import KVTier, TierStats, TierUnavailableError

logger = logging.getLogger(__name__)


class TierStack:
    def __init__(self, tiers: list[KVTier]) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"KV tiers {names}: each tier may appear once")
        self.tiers = tiers
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
                         self.snapshot())

    def fastest_holds(self, key: ObjectKey) -> bool:
        """Whether the fastest tier holds `key` (then a save of it is skipped)."""
        return bool(self.tiers) and self._holds(self.tiers[0], key)

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
            try:
                payload = decode(key, data)
            except CorruptObjectError as exc:
                logger.warning("KV tier %s: %s; deleted, trying the next tier", tier.name, exc)
                self._count(tier, corrupt=1)
                self._delete(tier, key)
                continue
            self._count(tier, hits=1, bytes_read=len(data))
            self._promote(key, data, self.tiers[:i])
            return payload, tier.name
        return None

    def promote(self, key: ObjectKey) -> bool:
        """Copy `key` up into the faster tiers that lack it (a prefetch); whether any holds it."""
        return self.get(key) is not None

    def demote(self, key: ObjectKey) -> bool:
        """Move `key` out of the fastest tier holding it into the slower ones lacking it
        (making room above for what is hotter). False if no reachable tier holds it or no
        slower tier could take it (then it stays where it is)."""
        for i, tier in enumerate(self.tiers):
            try:
                data = tier.get(key) if tier.contains(key) else None
            except TierUnavailableError:
                self._count(tier, errors=1)
                continue
            if data is None:
                continue
            try:
                decode(key, data)
            except CorruptObjectError as exc:
                logger.warning("KV tier %s: %s; deleted", tier.name, exc)
                self._count(tier, corrupt=1)
                self._delete(tier, key)
                continue
            below = self.tiers[i + 1 :]
            self._write(key, data, below, "bytes_written")
            if not any(self._holds(t, key) for t in below):
                return False
            self._delete(tier, key)
            return True
        return False

    def _holds(self, tier: KVTier, key: ObjectKey) -> bool:
        try:
            return tier.contains(key)
        except TierUnavailableError:
            self._count(tier, errors=1)
            return False

    def put(self, key: ObjectKey, data: bytes) -> list[str]:
        """Save an encoded object to every reachable tier lacking it; the tiers written."""
        return self._write(key, data, self.tiers, "bytes_written")

    def _promote(self, key: ObjectKey, data: bytes | memoryview, tiers: list[KVTier]) -> None:
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
