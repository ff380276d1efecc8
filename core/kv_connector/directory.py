"""The engine's mirror of a tier stack that lives in a worker process ("mp" executor).

The scheduler side asks, at admission, which tier holds each block of a prompt, and per
step whether the fastest tier already holds a block about to be saved. In-process it asks
the `TierStack` itself; over worker processes it asks this mirror, which answers from
the worker's reports: seeded once at start by the stack's `TierIndex` (the disk tier may
hold what earlier runs saved), then kept up to date by the `TierChange`s every
`WorkerReport` carries (objects saved, promoted, evicted, found corrupt and deleted).

The mirror is as fresh as the last report: a save the worker finished during the last
step is known from the next step on. It is never trusted for bytes: a block it says is
held but is gone by the time the worker reads it (a tier that evicts out of its sight,
like Redis under maxmemory) fails that load, and only the suffix from there is
recomputed, as with any failed load.

Counters: the worker's stack counts reads and writes and sends its counters with every
report; the scheduler side counts tokens loaded and recomputed here; `snapshot` adds the
two.
"""

from __future__ import annotations

import copy
import dataclasses

from tokenmill.kv_connector.objects import ObjectKey
from tokenmill.platforms.kv_messages import TierIndex, WorkerReport
from tokenmill.platforms.kv_tier import TierStats


class TierDirectory:
    """What each tier of a remote stack holds, as of its last report."""

    def __init__(self, index: TierIndex) -> None:
        if len(index.keys) != len(index.tiers):
            raise ValueError(f"a TierIndex of {len(index.tiers)} tiers with {len(index.keys)} key lists")
        self.tier_names = list(index.tiers)
        self.object_bytes = index.object_bytes
        self.host_objects = index.host_objects
        self._held: dict[str, set[ObjectKey]] = {
            name: set(keys) for name, keys in zip(index.tiers, index.keys)
        }
        self._worker_stats = dict(index.stats)
        self._local = {name: TierStats() for name in self.tier_names}  # token counters

    def apply(self, report: WorkerReport) -> None:
        """Bring the mirror up to the worker's state when it sent `report`."""
        for change in report.tier_changes:
            held = self._held.get(change.tier)
            if held is None:
                raise ValueError(f"a change for tier {change.tier!r}; the stack has {self.tier_names}")
            if change.held:
                held.add(change.key)
            else:
                held.discard(change.key)
        if report.tier_stats is not None:
            self._worker_stats = report.tier_stats

    def locate(self, keys: list[ObjectKey]) -> list[str | None]:
        """For each key, the fastest tier the mirror says holds it (None: none)."""
        return [
            next((name for name in self.tier_names if k in self._held[name]), None) for k in keys
        ]

    @property
    def host_name(self) -> str | None:
        """The host tier's name if the stack has one (always first)."""
        return self.tier_names[0] if self.tier_names and self.tier_names[0] == "host" else None

    @property
    def save_tier(self) -> str | None:
        """The first durable tier (None: none)."""
        return next((n for n in self.tier_names if n != self.host_name), None)

    def durable_holds(self, key: ObjectKey) -> bool:
        """Whether the first durable tier (below the host) holds `key`."""
        durable = [n for n in self.tier_names if n != self.host_name]
        return bool(durable) and key in self._held[durable[0]]

    def num_held(self, tier_name: str) -> int:
        return len(self._held[tier_name])

    def held(self, tier_name: str) -> set[ObjectKey]:
        """A copy of the keys the mirror says `tier_name` holds."""
        return set(self._held[tier_name])

    def count(self, tier_name: str, **deltas: int) -> None:
        """Add `deltas` to the counters kept here (the scheduler side's token counts)."""
        s = self._local[tier_name]
        for name, delta in deltas.items():
            setattr(s, name, getattr(s, name) + delta)

    def snapshot(self) -> dict[str, TierStats]:
        """Every tier's counters: the worker's last ones plus those counted here."""
        out = {}
        for name in self.tier_names:
            stats = copy.copy(self._worker_stats.get(name, TierStats()))
            for f in dataclasses.fields(TierStats):
                local = getattr(self._local[name], f.name)
                if local:
                    setattr(stats, f.name, getattr(stats, f.name) + local)
            out[name] = stats
        return out
