"""Recurrent state in the shared KV pool: one state slot per running sequence, plus
prefix-cache checkpoints, for a KV group of LINEAR layers (Gated DeltaNet, Mamba2, KDA).

A recurrent layer keeps a fixed-size state per sequence instead of per-token KV. The
group's `state_pages` block ids hold one state (every layer of the group has its page in
each, core/kv/groups.py); they come from the same `BlockPool` as attention blocks, so
the split between state and KV moves with the workload, and a state larger than a page
costs whole pages only up to its last one (no page padding grows with the state size).

- The slot: taken when the sequence first allocates, written by every step that
  computes its tokens, given back (reused before any cached page) when it finishes or
  is preempted. The worker reads it as the state before a step, except in a sequence's
  first step (zeros) or first step after a prefix-cache hit (the checkpoint's pages, read
  and never written: copy on extend).
- Checkpoints: the state after the sequence's first t tokens, t a block boundary, written
  by the step that computes token t - 1 into fresh pages and published under the key of
  block t / block_size - 1 (tagged per group and page), like a full attention block. A
  prefix-cache hit of t tokens needs one in every recurrent group. `CheckpointPolicy`
  says where they are taken.
- A KV tier's checkpoint (core/kv_connector/): a load that brings a prefix back from a
  tier allocates fresh pages for the checkpoint at its end (`allocate_load`) and no slot;
  once loaded they are published like a computed checkpoint, and the first step after
  reads them as a hit's restore source (copy on extend: its slot comes with that step).

The allocator has the interface of `FullAttentionAllocator` (the manager drives every
group alike); its "block table" is the slot. Pure Python with no device import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenmill.engine.request import Request
from tokenmill.kv.block_pool import BlockPool, KVBlock
from tokenmill.kv.groups import KVGroup
from tokenmill.kv.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """Where recurrent states are checkpointed: block boundaries t (token counts) that are

    - the prompt end, t = (prompt_len - 1) // block_size * block_size: the longest hit
      the same prompt (a retry, a parallel sample) can take;
    - every `interval_blocks` blocks (t a multiple of interval_blocks * block_size), kept;
    - the sequence's latest boundary (rolling: the previous rolling one is dropped when a
      new one is taken, and the last one stays cached when the sequence ends: the point
      an agent's next turn, which repeats the whole conversation, continues from).

    A sequence of n tokens so holds at most n / (interval_blocks * block_size) + 2
    checkpoints. `for_budget` picks the interval from a byte bound.
    """

    interval_blocks: int = 1

    def __post_init__(self) -> None:
        if self.interval_blocks < 1:
            raise ValueError(f"interval_blocks={self.interval_blocks} must be >= 1")

    @classmethod
    def for_budget(
        cls, checkpoint_pages: int, attention_pages_per_block: int, ratio: float = 0.5
    ) -> CheckpointPolicy:
        """The densest interval at which a sequence's kept interval checkpoints take at
        most `ratio` of the pages its attention KV takes for the same tokens: one
        checkpoint (`checkpoint_pages`, all recurrent groups together) every N blocks
        against `attention_pages_per_block` * N pages of attention. Without attention
        groups, every 16 blocks."""
        if ratio <= 0:
            raise ValueError(f"checkpoint ratio={ratio} must be > 0")
        if attention_pages_per_block == 0:
            return cls(16)
        return cls(max(1, math.ceil(checkpoint_pages / (ratio * attention_pages_per_block))))

    def boundaries(self, request: Request, block_size: int, lo: int, hi: int) -> tuple[list[int], int]:
        """The kept checkpoint boundaries t in (lo, hi], ascending, and the rolling one
        (the largest boundary in (lo, hi], 0 if none)."""
        first = lo // block_size + 1
        last = hi // block_size
        if last < first:
            return [], 0
        prompt_end = (request.num_prompt_tokens - 1) // block_size
        kept = [
            j * block_size
            for j in range(first, last + 1)
            if j % self.interval_blocks == 0 or j == prompt_end
        ]
        return kept, last * block_size


def checkpoint_key(block_hash: BlockHash, group_id: int, page: int) -> BlockHash:
    """The prefix-cache key of page `page` of group `group_id`'s checkpoint after the
    block whose key is `block_hash` (KV tiers name their objects by it too)."""
    return block_hash + b"/g%d/s%d" % (group_id, page)


@dataclass(slots=True)
class _Checkpoint:
    num_tokens: int
    pages: list[KVBlock]


@dataclass(slots=True)
class _SeqState:
    slot: list[KVBlock] = field(default_factory=list)
    restore: list[KVBlock] = field(default_factory=list)  # a hit's checkpoint, read once
    pending: list[_Checkpoint] = field(default_factory=list)  # written by the step in flight
    rolling: _Checkpoint | None = None  # the latest boundary's checkpoint, if not kept
    loading: int = 0  # restore's tokens while a KV tier loads it (0: a device hit or none)


class RecurrentStateAllocator:
    """State slots and checkpoints of one KV group of LINEAR layers."""

    def __init__(
        self, pool: BlockPool, block_size: int, group: KVGroup, policy: CheckpointPolicy
    ) -> None:
        if group.state is None or group.state_pages < 1:
            raise ValueError(f"group {group.group_id} declares no recurrent state: {group}")
        self.pool = pool
        self.block_size = block_size
        self.group_id = group.group_id
        self.state_pages = group.state_pages
        self.policy = policy
        self.seqs: dict[str, _SeqState] = {}
        # the manager's accounting reads the slots as this group's "tables"
        self.req_to_blocks: dict[str, list[KVBlock]] = {}

    # ---- keys and lookups ------------------------------------------------------------
    def key(self, block_hash: BlockHash, page: int = 0) -> BlockHash:
        """The prefix-cache key of page `page` of the checkpoint after the block whose
        key is `block_hash`."""
        return checkpoint_key(block_hash, self.group_id, page)

    def checkpoint_at(self, request: Request, num_blocks: int) -> list[KVBlock] | None:
        """The cached checkpoint after the request's first `num_blocks` blocks, if whole."""
        if num_blocks < 1 or num_blocks > len(request.block_hashes):
            return None
        block_hash = request.block_hashes[num_blocks - 1]
        pages = []
        for p in range(self.state_pages):
            block = self.pool.get_cached_block(self.key(block_hash, p))
            if block is None:
                return None
            pages.append(block)
        return pages

    def cached_blocks(self, request: Request, max_blocks: int) -> list[list[KVBlock] | None]:
        """Entry j - 1: the checkpoint after block j (None: not cached), j <= max_blocks."""
        return [self.checkpoint_at(request, j) for j in range(1, max_blocks + 1)]

    def hit_table(self, cached: list[list[KVBlock] | None], num_blocks: int) -> list[KVBlock]:
        """A hit of `num_blocks` blocks starts from the checkpoint after them."""
        pages = cached[num_blocks - 1] if num_blocks else None
        if pages is None:
            raise RuntimeError(f"no checkpoint after {num_blocks} blocks in group {self.group_id}")
        return list(pages)

    def hit_is_fresh(self, request: Request, table: list[KVBlock], num_blocks: int) -> bool:
        """Whether a hit's `table` is still the cached checkpoint after `num_blocks` blocks."""
        current = self.checkpoint_at(request, num_blocks)
        return current is not None and all(a is b for a, b in zip(current, table, strict=True))

    def first_needed_block(self, num_computed: int) -> int:
        return 0

    def release_outside_window(self, request: Request, num_computed: int) -> None:
        """The state has no window; nothing is released by position."""

    # ---- allocation --------------------------------------------------------------------
    def num_blocks_needed(
        self, request: Request, num_tokens: int, hits: list[KVBlock], num_computed: int = 0
    ) -> int:
        """Fresh pages so the request can compute up to `num_tokens` from `num_computed`:
        its slot (if it has none) and the checkpoints those tokens cross."""
        seq = self.seqs.get(request.request_id)
        need = 0 if seq is not None and seq.slot else self.state_pages
        kept, rolling = self._boundaries(request, num_computed, num_tokens)
        return need + self.state_pages * (len(kept) + (rolling > 0 and rolling not in kept))

    def _boundaries(self, request: Request, lo: int, hi: int) -> tuple[list[int], int]:
        # only boundaries whose block is hashed can be published (no prefix caching: none)
        hi = min(hi, len(request.block_hashes) * self.block_size)
        if hi <= lo:
            return [], 0
        return self.policy.boundaries(request, self.block_size, lo, hi)

    def take_hits(self, request: Request, hits: list[KVBlock]) -> None:
        """Start the request from a checkpoint (a reference is held until its next
        allocation: the first step reads it)."""
        if not hits:
            return
        seq = self.seqs.setdefault(request.request_id, _SeqState())
        self.pool.touch(hits)
        seq.restore = list(hits)

    def allocate_load(self, request: Request, num_tokens: int) -> None:
        """Fresh pages for the checkpoint after `num_tokens` (a block boundary) that a KV
        tier loads; the request holds nothing else here until its first step allocates
        (its slot, reading these pages as a hit's checkpoint). `cache_full_blocks`
        publishes them once loaded; `free` drops them if the load fails."""
        seq = self.seqs.setdefault(request.request_id, _SeqState())
        if seq.slot or seq.restore:
            raise RuntimeError(f"request {request.request_id!r} already holds state in group "
                               f"{self.group_id}: a KV tier's checkpoint only starts a request")
        seq.restore = self.pool.allocate(self.state_pages)
        seq.loading = num_tokens

    def allocate_slot(self, request: Request) -> list[KVBlock]:
        """The slot alone, for a state that arrives from another engine (a prefill
        engine's, core/kv_connector/handover/): the request's next step reads it as the
        state before its query, as for any running sequence."""
        seq = self.seqs.setdefault(request.request_id, _SeqState())
        if seq.slot or seq.restore:
            raise RuntimeError(f"request {request.request_id!r} already holds state in group "
                               f"{self.group_id}: a handed-over state only starts a request")
        seq.slot = self.pool.allocate(self.state_pages)
        self.req_to_blocks[request.request_id] = seq.slot
        return seq.slot

    def load_block_ids(self, request: Request) -> list[int]:
        """The pages a KV tier's checkpoint is being loaded into (empty: none)."""
        seq = self.seqs.get(request.request_id)
        return [b.block_id for b in seq.restore] if seq is not None and seq.loading else []

    def allocate(self, request: Request, num_tokens: int, num_computed: int = 0) -> None:
        """Take the slot (first time) and the checkpoint pages of the boundaries in
        (num_computed, num_tokens]; drop what the previous step needed (its restore
        source and the references on the checkpoints it wrote)."""
        rid = request.request_id
        seq = self.seqs.setdefault(rid, _SeqState())
        if not seq.slot:
            seq.slot = self.pool.allocate(self.state_pages)
            self.req_to_blocks[rid] = seq.slot
            restore = seq.restore  # taken this call: the step reads it
        else:
            self._release_step(seq)
            restore = []
        kept, rolling = self._boundaries(request, num_computed, num_tokens)
        for t in kept:
            seq.pending.append(_Checkpoint(t, self.pool.allocate(self.state_pages)))
        if rolling and rolling not in kept:
            seq.pending.append(_Checkpoint(rolling, self.pool.allocate(self.state_pages)))
        if rolling:
            if seq.rolling is not None:  # superseded: its content is no longer wanted
                self.pool.uncache(self._published(request, seq.rolling))
            latest = seq.pending[-1]
            seq.rolling = latest if latest.num_tokens not in kept else None
        seq.restore = restore

    def _release_step(self, seq: _SeqState) -> None:
        self.pool.free(seq.restore)
        for ckpt in seq.pending:
            self.pool.free(ckpt.pages)
        seq.restore, seq.pending = [], []

    def _published(self, request: Request, ckpt: _Checkpoint) -> list[KVBlock]:
        """The pages of `ckpt` that are the cached ones under its keys (another sequence
        may have published the same boundary first)."""
        block_hash = request.block_hashes[ckpt.num_tokens // self.block_size - 1]
        return [
            page for p, page in enumerate(ckpt.pages)
            if self.pool.get_cached_block(self.key(block_hash, p)) is page
        ]

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the checkpoints the step in flight writes (boundaries <= num_tokens)."""
        seq = self.seqs.get(request.request_id)
        if seq is None:
            return
        if seq.loading and seq.loading <= num_tokens:  # a KV tier's checkpoint, now loaded
            block_hash = request.block_hashes[seq.loading // self.block_size - 1]
            for p, page in enumerate(seq.restore):
                self.pool.cache(page, self.key(block_hash, p))
            seq.loading = 0
        for ckpt in seq.pending:
            if ckpt.num_tokens <= num_tokens:
                block_hash = request.block_hashes[ckpt.num_tokens // self.block_size - 1]
                for p, page in enumerate(ckpt.pages):
                    self.pool.cache(page, self.key(block_hash, p))
                published = self._published(request, ckpt)
                if len(published) == len(ckpt.pages):  # one unit: evicted together
                    self.pool.link(published)

    def kept_checkpoints(self, request: Request) -> list[tuple[BlockHash, int]]:
        """The kept checkpoints the step just allocated writes and this request published:
        (prefix-cache key, block id) per page (KV offload saves them after the step)."""
        seq = self.seqs.get(request.request_id)
        if seq is None:
            return []
        return [
            (page.block_hash, page.block_id)
            for ckpt in seq.pending if ckpt is not seq.rolling
            for page in self._published(request, ckpt)
        ]

    def rolling_checkpoint(self, request: Request) -> list[KVBlock]:
        """The request's rolling checkpoint pages that are the cached ones (its latest
        boundary's state when it is not a kept one; empty: none). Call before `free`:
        the caller's computed steps wrote it."""
        seq = self.seqs.get(request.request_id)
        if seq is None or seq.rolling is None:
            return []
        return self._published(request, seq.rolling)

    def step_ops(self, request: Request) -> tuple[list[int], list[tuple[int, list[int]]]]:
        """What the worker does with this group's state in the step just allocated: the
        checkpoint to restore from (block ids, empty: none) and the checkpoints to write
        as (token count, block ids)."""
        seq = self.seqs.get(request.request_id)
        if seq is None:
            return [], []
        return (
            [b.block_id for b in seq.restore],
            [(c.num_tokens, [b.block_id for b in c.pages]) for c in seq.pending],
        )

    def free(self, request: Request) -> None:
        """Give back the slot (reused before cached pages) and the step's references;
        published checkpoints stay cached (the rolling one too: the sequence's end)."""
        seq = self.seqs.pop(request.request_id, None)
        self.req_to_blocks.pop(request.request_id, None)
        if seq is None:
            return
        self._release_step(seq)
        self.pool.free(seq.slot, reuse_first=True)

    # ---- accounting --------------------------------------------------------------------
    def block_ids(self, request: Request) -> list[int]:
        """The slot's block ids (this group's table)."""
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, ())]

    def num_held(self, request: Request) -> int:
        """Pages the request holds in this group: its slot, a restore source, and the
        checkpoints its step in flight writes."""
        seq = self.seqs.get(request.request_id)
        if seq is None:
            return 0
        return len(seq.slot) + len(seq.restore) + sum(len(c.pages) for c in seq.pending)

    def held_blocks(self, request_id: str) -> list[KVBlock]:
        """Every page the request references in this group."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return []
        return [*seq.slot, *seq.restore, *(b for c in seq.pending for b in c.pages)]
