"""The shadow of "benefit" eviction, shared by the arena's state machines
(tests/test_kv_groups_property.py, tests/test_recurrent_property.py).

- `CheckedPool` checks every eviction against a brute-force scan of its blocks: a cached
  block is taken only when no uncached block is free, and never one of higher priority
  than a free cached block that stays.
- `expected_benefits` computes, from the documented definition and independently of
  `PrefixScorer`, the benefit of every cached page of a request's computed prefix: its
  hit points are the boundaries where `find_cached_prefix` of a probe request (the prefix
  plus one token) hits exactly there, segment k holds the pages the hit at p_k uses that
  no shallower hit point's uses, S_k = (C(p_k) - C(p_{k-1})) / its pages with C summed
  token by token, and each page gets the largest S of its segment and the deeper ones.
- `check_scores` frees a request and checks every page's priority or benefit after.
"""

from __future__ import annotations

import math

from tokenmill.engine.request import Request
from tokenmill.kv.allocators import SlidingWindowAllocator
from tokenmill.kv.block_pool import BlockPool, KVBlock
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv.recurrent import RecurrentStateAllocator
from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill.sampling_params import SamplingParams


class CheckedPool(BlockPool):
    num_evictions = 0  # cached blocks taken under "benefit"

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.freed_clock: dict[int, float] = {}  # block id -> the clock when it was freed

    def free(self, blocks, reuse_first: bool = False) -> None:
        blocks = list(blocks)
        super().free(blocks, reuse_first)
        for block in blocks:
            if block.ref_cnt == 0:
                self.freed_clock[block.block_id] = self.clock

    def _take(self) -> KVBlock:
        free = [b for b in self.blocks[self.num_reserved :] if b.ref_cnt == 0]
        cached = {id(b): b.priority for b in free if b.block_hash is not None}
        holding_nothing = len(free) - len(cached)
        block = super()._take()
        if id(block) in cached and self.eviction == "benefit":
            self.num_evictions += 1
            assert not holding_nothing, "evicted a cached block with uncached ones free"
            others = [p for k, p in cached.items() if k != id(block)]
            assert cached[id(block)] <= min(others, default=math.inf), "not the least priority"
        return block


def install_checked_pool(kv: KVCacheManager) -> CheckedPool:
    """Give the manager (before any use) a `CheckedPool` of the same shape."""
    old = kv.pool
    pool = CheckedPool(old.num_blocks, old.enable_caching, bool(old.num_reserved), old.eviction)
    kv.pool = pool
    for alloc in kv.allocators:
        alloc.pool = pool
    return pool


def prefix_cost(specs: list[AttentionSpec], t: int) -> float:
    """C(t) token by token: per layer 1 + visible positions / (6 x the widest width)."""
    span = 6 * max(s.num_heads * s.head_size for s in specs if s.kind != AttentionKind.LINEAR)
    total = 0.0
    for spec in specs:
        for p in range(t):
            total += 1
            if spec.kind == AttentionKind.LINEAR:
                continue
            visible = p + 1 if spec.sliding_window is None else min(p + 1, spec.sliding_window)
            total += visible / span
    return total


def _prefix_pages(kv: KVCacheManager, request: Request, n: int) -> dict[int, bool]:
    """Block id -> whether it is a window block, for every cached page of the prefix."""
    pages = {}
    for alloc in kv.allocators:
        if isinstance(alloc, RecurrentStateAllocator):
            for j in range(1, n + 1):
                pages.update((b.block_id, False) for b in alloc.checkpoint_at(request, j) or [])
            continue
        for h in request.block_hashes[:n]:
            block = kv.pool.get_cached_block(alloc.key(h))
            if block is not None:
                pages[block.block_id] = isinstance(alloc, SlidingWindowAllocator)
    return pages


def expected_benefits(
    kv: KVCacheManager, specs: list[AttentionSpec], request: Request
) -> dict[int, float]:
    """Block id -> its benefit per the stated score, for every cached page of the
    request's computed prefix."""
    bs = kv.block_size
    n = min(len(request.block_hashes), request.num_computed_tokens // bs)
    tokens = request.all_token_ids
    uses: dict[int, set[int]] = {}  # hit point -> block ids its hit uses
    for j in range(1, n + 1):
        probe = Request("probe", tokens[: j * bs] + [0], SamplingParams(max_tokens=1))
        hit, num = kv.find_cached_prefix(probe)
        if num == j * bs:
            uses[j] = {b.block_id for b in hit.blocks()}
    out = dict.fromkeys(_prefix_pages(kv, request, n), 0.0)
    segments, seen, lo = [], set(), 0
    for j in sorted(uses):
        own = uses[j] - seen
        seen |= uses[j]
        segments.append((own, (prefix_cost(specs, j * bs) - prefix_cost(specs, lo * bs)) / len(own)))
        lo = j
    best = 0.0
    for own, value in reversed(segments):
        best = max(best, value)
        for block_id in own:
            out[block_id] = best
    return out


def free_and_check_scores(kv: KVCacheManager, specs: list[AttentionSpec], request: Request) -> None:
    """`kv.free(request)`, checking after it that every cached page of its prefix has the
    stated score: a free one priority max(its priority before, base + benefit), base the
    clock when it was freed for a window block, the clock now for others; a held one that
    benefit (its priority when it becomes free)."""
    pool = kv.pool
    assert isinstance(pool, CheckedPool)
    expected = expected_benefits(kv, specs, request)
    windowed = _prefix_pages(kv, request, len(request.block_hashes))
    before = {i: pool.blocks[i].priority for i in expected if pool.blocks[i].ref_cnt == 0}
    clock = pool.clock
    kv.free(request)
    assert pool.clock == clock  # freeing evicts nothing
    for block_id, benefit in expected.items():
        block = pool.blocks[block_id]
        assert math.isclose(block.benefit, benefit, rel_tol=1e-9, abs_tol=1e-12), (
            block_id, block.benefit, benefit)
        if block.ref_cnt:
            continue
        base = clock
        if windowed[block_id] and block_id in before:
            base = pool.freed_clock[block_id]
        want = max(before.get(block_id, -math.inf), base + benefit)
        assert block.entry >= 0 and math.isclose(block.priority, want, rel_tol=1e-9), (
            block_id, block.priority, want)
