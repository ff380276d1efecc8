"""KV accounting for requests: which blocks each request holds, prefix-cache lookups and
admission. One allocator per KV group (core/kv/groups.py) draws from the shared
`BlockPool`; there is no split between attention types.

- Admission and growth check the joint need: a step's allocation for a request succeeds
  only if the fresh blocks of every group together fit the free blocks.
- A sliding-window group gives back the blocks leaving its window before each
  allocation, so its share shrinks to the windows while full attention's grows with the
  context; the pool's split moves with the workload on its own.
- A prefix-cache hit is as long as every group allows: full attention needs every block
  of the prefix cached, a sliding window only the blocks its next query reads.
- Under pressure, free cached pages of any type are evicted by benefit per byte
  (`eviction="benefit"`, the default: the recompute a page saves per block id it takes,
  core/kv/eviction.py), or least recently freed first (`eviction="lru"`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tokenmill.engine.request import Request
from tokenmill.kv.allocators import FullAttentionAllocator, SlidingWindowAllocator
from tokenmill.kv.block_pool import NULL_BLOCK, BlockPool, EvictionPolicy, KVBlock
from tokenmill.kv.eviction import PrefixScorer, RecomputeCost
from tokenmill.kv.groups import KVGroup
from tokenmill.kv.hashing import hash_blocks
from tokenmill.kv.recurrent import CheckpointPolicy, RecurrentStateAllocator
from tokenmill.platforms.interfaces import AttentionKind


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache


@dataclass(slots=True)
class PrefixHit:
    """A prefix-cache hit: its length and the table each group starts with."""

    num_tokens: int = 0
    tables: list[list[KVBlock]] = field(default_factory=list)  # per group; NULL_BLOCK holes

    def __len__(self) -> int:  # blocks per table (a recurrent group's: its checkpoint's pages)
        return max((len(t) for t in self.tables), default=0)

    def blocks(self) -> list[KVBlock]:
        """The distinct real blocks of the hit."""
        seen = {id(b): b for t in self.tables for b in t if b is not NULL_BLOCK}
        return list(seen.values())


class KVCacheManager:
    """The scheduler's view of KV memory. Pure Python; never touches tensors.

    `groups` (from `plan_groups`) defaults to one full-attention group: a plain model.
    Groups of LINEAR layers get a `RecurrentStateAllocator` (core/kv/recurrent.py) whose
    checkpoints follow `checkpoint_policy`; None: `CheckpointPolicy.for_budget` with
    `checkpoint_ratio` (kept checkpoints take at most that share of the attention KV of
    the same tokens). `eviction`: see `BlockPool`; `recompute_cost` prices a prefix for
    "benefit" eviction (None: `RecomputeCost.for_groups(groups)`, a default width).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        groups: tuple[KVGroup, ...] | None = None,
        checkpoint_policy: CheckpointPolicy | None = None,
        checkpoint_ratio: float = 0.5,
        eviction: EvictionPolicy = "benefit",
        recompute_cost: RecomputeCost | None = None,
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        groups = groups or (KVGroup(0, AttentionKind.FULL, None, ()),)
        windowed = any(g.kind == AttentionKind.SLIDING_WINDOW for g in groups)
        self.pool = BlockPool(
            num_blocks, enable_caching=enable_prefix_caching, reserve_null=windowed,
            eviction=eviction,
        )
        recurrent = [g for g in groups if g.kind == AttentionKind.LINEAR]
        if checkpoint_policy is None and recurrent:
            checkpoint_policy = CheckpointPolicy.for_budget(
                sum(g.state_pages for g in recurrent), len(groups) - len(recurrent),
                checkpoint_ratio,
            )
        self.checkpoint_policy = checkpoint_policy
        self.allocators: list[FullAttentionAllocator | RecurrentStateAllocator] = [
            self._allocator(g, block_size) for g in groups
        ]
        self.groups = groups
        self.stats = PrefixCacheStats()
        self.scorer = PrefixScorer(
            self.allocators, block_size, recompute_cost or RecomputeCost.for_groups(groups)
        )
        self._published: dict[str, int] = {}  # request id -> blocks scored at publication

    def _allocator(
        self, group: KVGroup, block_size: int
    ) -> FullAttentionAllocator | RecurrentStateAllocator:
        if group.kind == AttentionKind.SLIDING_WINDOW:
            return SlidingWindowAllocator(self.pool, block_size, group)
        if group.kind == AttentionKind.LINEAR:
            return RecurrentStateAllocator(self.pool, block_size, group, self.checkpoint_policy)
        return FullAttentionAllocator(self.pool, block_size, group)

    @property
    def recurrent_group_ids(self) -> list[int]:
        """The groups of LINEAR layers (state slots and checkpoints)."""
        return [i for i, a in enumerate(self.allocators) if isinstance(a, RecurrentStateAllocator)]

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_groups(self) -> int:
        return len(self.allocators)

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's block keys to cover its newly full blocks."""
        if not self.enable_prefix_caching:
            return
        start = len(request.block_hashes)
        parent = request.block_hashes[-1] if start else None
        request.block_hashes.extend(
            hash_blocks(request.all_token_ids, self.block_size, request.extra_keys, start, parent)
        )

    def find_cached_prefix(self, request: Request) -> tuple[PrefixHit, int]:
        """The longest cached prefix every group can serve, and its length in tokens.

        Full-attention groups bound it by their leading run of cached blocks; from there
        the length steps down a block at a time until each sliding-window group has the
        blocks its next query reads and each recurrent group has a checkpoint exactly at
        that boundary. At least one token is always left to compute, since the step that
        computes it produces the logits to sample from.
        """
        empty = PrefixHit(0, [[] for _ in self.allocators])
        if not self.enable_prefix_caching:
            return empty, 0
        self.update_block_hashes(request)
        if request.sampling_params.prompt_logprobs is not None:
            return empty, 0  # every prompt position must be computed to score it
        max_blocks = (request.num_tokens - 1) // self.block_size
        cached: dict[int, list] = {}
        recurrent = self.recurrent_group_ids
        for i, alloc in enumerate(self.allocators):  # full attention bounds the others' scan
            if type(alloc) is FullAttentionAllocator:
                cached[i] = alloc.cached_blocks(request, max_blocks)
                max_blocks = min(max_blocks, len(cached[i]))
        misses: dict[int, list[int]] = {}  # per window group: misses among its first j blocks
        for i, alloc in enumerate(self.allocators):
            if isinstance(alloc, SlidingWindowAllocator):
                cached[i] = alloc.cached_blocks(request, max_blocks)
                misses[i] = list(itertools.accumulate((b is None for b in cached[i]), initial=0))
            elif i in recurrent:
                cached[i] = alloc.cached_blocks(request, max_blocks)
        for num_blocks in range(max_blocks, 0, -1):
            first = {i: self.allocators[i].first_needed_block(num_blocks * self.block_size)
                     for i in misses}
            if all(m[num_blocks] == m[first[i]] for i, m in misses.items()) and all(
                cached[i][num_blocks - 1] is not None for i in recurrent
            ):
                tables = [a.hit_table(cached[i], num_blocks) for i, a in enumerate(self.allocators)]
                return PrefixHit(num_blocks * self.block_size, tables), num_blocks * self.block_size
        return empty, 0

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count one admitted request's prefix-cache lookup in the stats."""
        self.stats.queries += num_queried
        self.stats.hits += num_hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hits: PrefixHit | None = None,
        publish: bool = True,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Reserve KV for `num_new_tokens` more tokens (after `hits`, if any), and
        attention slots for `num_lookahead_tokens` after them (speculative decoding's
        drafts: never published, as only the request's own tokens' blocks are keyed;
        recurrent groups take nothing for them, and `trim` gives them back).

        `hits` are for a request that holds no KV yet, and must be what
        `find_cached_prefix` returned with no allocation in between: allocating may evict
        cached blocks, so an older lookup may name a block that now holds another
        request's tokens. Stale hits raise RuntimeError.

        First every sliding-window group gives back the blocks no query of the request
        reads any more (always safe: they are never needed again). Then, if the fresh
        blocks of all groups together fit, allocates them; else returns False and changes
        nothing more. `publish=False` keeps every group's new blocks out of the prefix
        cache (their content is still being loaded by the KV connector; `cache_blocks`
        publishes them after), and a recurrent group then takes only the pages of the
        checkpoint at the end of the load (`RecurrentStateAllocator.allocate_load`; a
        device hit's checkpoint in `hits` is not taken: the load brings a later one).
        """
        num_hit = hits.num_tokens if hits is not None else 0
        recurrent = self.recurrent_group_ids
        if hits is not None and hits.tables and recurrent and not publish:
            hits = PrefixHit(num_hit, [[] if i in recurrent else t for i, t in enumerate(hits.tables)])
        if num_hit:
            self._check_hits(request, hits, check_recurrent=publish)
        num_computed = request.num_computed_tokens + num_hit
        total = num_computed + num_new_tokens
        tables = hits.tables if hits is not None and hits.tables else [[] for _ in self.allocators]
        if recurrent and publish:
            self.update_block_hashes(request)  # checkpoints are keyed by the blocks they end
        for alloc in self.allocators:
            alloc.release_outside_window(request, num_computed)
        need = sum(
            (alloc.num_blocks_needed(request, total, table, num_computed) if publish
             else alloc.state_pages)
            if i in recurrent
            else alloc.num_blocks_needed(request, total + num_lookahead_tokens, table)
            for i, (alloc, table) in enumerate(zip(self.allocators, tables, strict=True))
        )
        # Cached hits sitting in the free queue stop being allocatable once touched.
        num_hits_free = sum(1 for b in (hits.blocks() if hits else ()) if b.ref_cnt == 0)
        if need + num_hits_free > self.pool.num_free_blocks:
            return False
        for alloc, table in zip(self.allocators, tables, strict=True):
            alloc.take_hits(request, table)
        for i, alloc in enumerate(self.allocators):
            if i in recurrent and publish:
                alloc.allocate(request, total, num_computed)
            elif i in recurrent:
                alloc.allocate_load(request, total)
            else:
                alloc.allocate(request, total + num_lookahead_tokens)
        if self.enable_prefix_caching and publish:
            self.update_block_hashes(request)
            for alloc in self.allocators:
                alloc.cache_full_blocks(request, total)
            self._score_published(request, num_computed, total)
        return True

    def trim(self, request: Request, num_tokens: int) -> list[int] | None:
        """Give back the attention blocks past the first `num_tokens` tokens' (those only
        rejected drafts wrote: unpublished, as no key reaches past the request's tokens).
        Returns every group's table length after, or None if nothing was given back."""
        keep = -(-num_tokens // self.block_size)
        cut = False
        for alloc in self.allocators:
            blocks = alloc.req_to_blocks.get(request.request_id) if not isinstance(
                alloc, RecurrentStateAllocator) else None
            if blocks and len(blocks) > keep:
                extra = blocks[keep:]
                del blocks[keep:]
                self.pool.free(b for b in reversed(extra) if b is not NULL_BLOCK)
                cut = True
        return [len(t) for t in self.group_block_ids(request)] if cut else None

    def _score_published(self, request: Request, num_computed: int, total: int) -> None:
        """Provisional benefits for the pages just published (`PrefixScorer.provisional`):
        blocks from the last scored one (at first: the end of the hit) to `total` tokens."""
        if self.pool.eviction != "benefit":
            return
        rid = request.request_id
        first = self._published.setdefault(rid, num_computed // self.block_size)
        last = min(total // self.block_size, len(request.block_hashes))
        tables = [a.req_to_blocks.get(rid, []) for a in self.allocators
                  if not isinstance(a, RecurrentStateAllocator)]
        self.scorer.provisional(request, tables, first, last)
        self._published[rid] = max(first, last)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish, in every group, the request's blocks that its first `num_tokens`
        tokens fill."""
        if self.enable_prefix_caching:
            self.update_block_hashes(request)
            for alloc in self.allocators:
                alloc.cache_full_blocks(request, num_tokens)
            self._score_published(request, request.num_computed_tokens, num_tokens)

    def _check_hits(self, request: Request, hits: PrefixHit, check_recurrent: bool = True) -> None:
        if request.num_computed_tokens or any(
            alloc.req_to_blocks.get(request.request_id) for alloc in self.allocators
        ):
            raise RuntimeError(
                f"request {request.request_id!r} already holds KV: prefix-cache hits only "
                "start a request"
            )
        num_blocks = hits.num_tokens // self.block_size
        for alloc, table in zip(self.allocators, hits.tables, strict=True):
            if isinstance(alloc, RecurrentStateAllocator):
                if check_recurrent and not alloc.hit_is_fresh(request, table, num_blocks):
                    raise RuntimeError(
                        f"stale prefix-cache hits for request {request.request_id!r}: look "
                        "them up again (find_cached_prefix) right before allocate_slots"
                    )
                continue
            if len(table) > len(request.block_hashes) or any(
                b is not NULL_BLOCK and alloc.pool.get_cached_block(alloc.key(h)) is not b
                for b, h in zip(table, request.block_hashes)
            ):
                raise RuntimeError(
                    f"stale prefix-cache hits for request {request.request_id!r}: look them "
                    "up again (find_cached_prefix) right before allocate_slots"
                )

    def free(self, request: Request) -> None:
        """Give back the request's KV. Under "benefit" eviction its computed prefix's
        cached pages are scored first (`PrefixScorer.score_chain`)."""
        if self.enable_prefix_caching and self.pool.eviction == "benefit":
            self.scorer.score_chain(request)
        self._published.pop(request.request_id, None)
        for alloc in self.allocators:
            alloc.free(request)

    def block_ids(self, request: Request) -> list[int]:
        """Group 0's block table (the only one of a plain model)."""
        return self.allocators[0].block_ids(request)

    def load_block_ids(self, request: Request) -> list[list[int]]:
        """Every group's blocks a KV connector load fills, after `allocate_slots(...,
        publish=False)`: the block table, or a recurrent group's checkpoint pages."""
        return [
            alloc.load_block_ids(request) if isinstance(alloc, RecurrentStateAllocator)
            else alloc.block_ids(request)
            for alloc in self.allocators
        ]

    def checkpoint_saves(self, request: Request) -> list[tuple[bytes, int]]:
        """The kept recurrent-state checkpoints the step just allocated writes, as
        (prefix-cache key, block id) per page, in every recurrent group."""
        return [kb for i in self.recurrent_group_ids
                for kb in self.allocators[i].kept_checkpoints(request)]

    def hold_rolling_checkpoints(self, request: Request) -> list[KVBlock]:
        """Before `free`: the request's rolling checkpoint pages in every recurrent group
        (its latest state, where an agent's next turn continues), each with one more
        reference so no allocation reuses them; give it back with `release`."""
        pages = [b for i in self.recurrent_group_ids
                 for b in self.allocators[i].rolling_checkpoint(request)]
        self.pool.touch(pages)
        return pages

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop references taken by `hold_rolling_checkpoints`."""
        self.pool.free(blocks)

    def group_block_ids(self, request: Request) -> list[list[int]]:
        """Every group's block table, in group order; null entries are NULL_BLOCK's id."""
        return [alloc.block_ids(request) for alloc in self.allocators]

    def num_blocks_held(self, request: Request) -> list[int]:
        """Real blocks the request holds, per group (its KV bytes: each block is one page
        per arena slot)."""
        return [alloc.num_held(request) for alloc in self.allocators]

    def blocks_in_use_per_group(self) -> list[int]:
        """Real blocks held by live requests, per group (a block shared by several
        requests counts once; a recurrent group counts slots, restore sources and the
        checkpoints being written)."""
        out = []
        for alloc in self.allocators:
            if isinstance(alloc, RecurrentStateAllocator):
                ids = {b.block_id for rid in alloc.seqs for b in alloc.held_blocks(rid)}
            else:
                ids = {b.block_id for t in alloc.req_to_blocks.values()
                       for b in t if b is not NULL_BLOCK}
            out.append(len(ids))
        return out

    def blocks_in_use_by_type(self) -> dict[str, int]:
        """Block ids held by live requests, per attention type ("full", "sliding_window",
        "linear"): the arena's live split between the types (a metric)."""
        out: dict[str, int] = {}
        for group, n in zip(self.groups, self.blocks_in_use_per_group(), strict=True):
            out[group.kind.value] = out.get(group.kind.value, 0) + n
        return out

    def recurrent_step_ops(self, request: Request) -> list[tuple[int, list[int], list[tuple[int, list[int]]]]]:
        """Per recurrent group, what the workers do with the request's state in the step
        just allocated: (group id, checkpoint block ids to restore from (empty: none),
        checkpoints to write as (token count, block ids))."""
        out = []
        for i in self.recurrent_group_ids:
            restore, checkpoints = self.allocators[i].step_ops(request)
            if restore or checkpoints:
                out.append((i, restore, checkpoints))
        return out

    def blocks_for_one_request(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once, computing at
        most `max_chunk` tokens a step: a window holds its blocks plus one chunk's."""
        total = 0
        for alloc in self.allocators:
            blocks = -(-num_tokens // self.block_size)
            if isinstance(alloc, RecurrentStateAllocator):
                # the slot, a restore source, and the checkpoints one chunk writes: the
                # interval ones it crosses, the prompt end's and the rolling one
                interval = alloc.policy.interval_blocks * self.block_size
                num_ckpts = min(blocks, max_chunk // interval + 1) + 2
                total += alloc.state_pages * (2 + num_ckpts)
                continue
            if isinstance(alloc, SlidingWindowAllocator):
                blocks = min(blocks, -(-(alloc.window - 1 + max_chunk) // self.block_size) + 1)
            total += blocks
        return total

    def max_request_tokens(self, max_chunk: int) -> int:
        """The longest request the pool can hold alone (see `blocks_for_one_request`)."""
        lo, hi = 0, self.pool.num_usable_blocks * self.block_size
        while lo < hi:  # the need grows with the length: bisect
            mid = (lo + hi + 1) // 2
            if self.blocks_for_one_request(mid, max_chunk) <= self.pool.num_usable_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
