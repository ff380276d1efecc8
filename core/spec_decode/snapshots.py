"""Exact rollback of recurrent state (Gated DeltaNet, Mamba2, KDA layers) after rejected
drafts: per-position state snapshots.

A verification step computes 1 + k tokens through every recurrent layer, which leaves
the state after all of them in the request's slot; if only j < k drafts are accepted the
state wanted is the one after the step's first 1 + j tokens. We keep it rather than
recompute it: the step writes the state after each of its first k tokens into snapshot
pages (the step description's ordinary recurrent checkpoints, `RecurrentStateOps`), and
the next step reads the accepted one as its source (`restore_block_ids`: read, never
written, the slot written as after a prefix-cache hit). Why snapshots and not
recomputing the accepted tokens: a recompute is a second pass through every layer (or a
second step) for j tokens, while a snapshot costs writing k states, a few copies of a
state that is small next to the layer's weights; SGLang and vLLM keep per-position
states for the same reason. Sliding windows need nothing: a rejected position's KV is
overwritten before any query reads it, and a window frees blocks only by the step's
first position, which a rollback never goes behind.

Each request holds k + 1 sets of snapshot pages per recurrent group (from the shared
pool, while it speculates): a step writes k sets, never the one it restores from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.kv.block_pool import BlockPool, KVBlock


@dataclass(slots=True)
class _Held:
    sets: dict[int, list[list[KVBlock]]]  # group id -> k + 1 sets of state pages
    restore: int | None = None  # the set the next step restores from (None: the slot)
    written: list[int] = field(default_factory=list)  # sets the last step wrote, by position


class StateSnapshots:
    """Snapshot pages of speculating requests, for the recurrent groups of one pool.

    `group_pages`: group id -> pages one state takes (`KVGroup.state_pages`)."""

    def __init__(self, pool: BlockPool, group_pages: dict[int, int], num_sets: int) -> None:
        self.pool = pool
        self.group_pages = group_pages
        self.num_sets = num_sets  # k + 1
        self._held: dict[str, _Held] = {}

    @property
    def pages_per_request(self) -> int:
        return self.num_sets * sum(self.group_pages.values())

    def ensure(self, request_id: str) -> bool:
        """Hold the request's snapshot pages; False (nothing taken) if they do not fit."""
        if request_id in self._held or not self.group_pages:
            return True
        if self.pool.num_free_blocks < self.pages_per_request:
            return False
        sets = {g: [self.pool.allocate(n) for _ in range(self.num_sets)]
                for g, n in self.group_pages.items()}
        self._held[request_id] = _Held(sets)
        return True

    def step_ops(self, request_id: str, start: int, num_drafts: int
                 ) -> dict[int, tuple[list[int], list[tuple[int, list[int]]]]]:
        """Per group: (pages to restore the state from (empty: the slot), snapshots to
        write as (tokens, pages)) for a step computing 1 + num_drafts tokens from
        `start`. Empty when the request holds no snapshots."""
        held = self._held.get(request_id)
        if held is None:
            return {}
        free = [i for i in range(self.num_sets) if i != held.restore]
        held.written = free[:num_drafts]
        out = {}
        for g, sets in held.sets.items():
            restore = [b.block_id for b in sets[held.restore]] if held.restore is not None else []
            snaps = [(start + 1 + i, [b.block_id for b in sets[s]])
                     for i, s in enumerate(held.written)]
            if restore or snaps:
                out[g] = (restore, snaps)
        held.restore = None
        return out

    def verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The last step's drafts were verified: the next step starts from the state
        after 1 + num_accepted of its tokens (a snapshot unless all were accepted)."""
        held = self._held.get(request_id)
        if held is None or num_accepted >= num_drafts:
            return
        # the snapshot after the step's first 1 + j tokens is the one at position j
        held.restore = held.written[num_accepted]

    def release(self, request_id: str) -> None:
        """The request ended or was preempted (its state is recomputed): pages back."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self.pool.free(b for sets in held.sets.values() for s in sets for b in s)
