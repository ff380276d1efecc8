"""Eviction of free cached KV pages by benefit per byte (core/kv/eviction.py) against the
least-recently-freed order, on the pool and on the KV manager (no model; the end-to-end
check with greedy outputs against transformers is in tests/test_qwen3_next.py)."""

from __future__ import annotations

import pytest
import torch
from kv_eviction_shadow import prefix_cost

from tokenmill.engine.request import Request
from tokenmill.kv.block_pool import BlockPool
from tokenmill.kv.eviction import RecomputeCost
from tokenmill.kv.groups import plan_groups
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv.recurrent import CheckpointPolicy
from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill.platforms.ops.linear_attention import gated_delta_state_spec
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
STATE = gated_delta_state_spec(24, 4, 2, 8, 4, torch.float32)  # 3 pages of 256 bytes
HYBRID = [  # a Gated DeltaNet layer and a full-attention one
    AttentionSpec(AttentionKind.LINEAR, 2, 1, 8, torch.float32, BLOCK, state=STATE),
    AttentionSpec(AttentionKind.FULL, 2, 1, 8, torch.float32, BLOCK),
]
GEMMA_LIKE = [
    AttentionSpec(AttentionKind.SLIDING_WINDOW, 2, 1, 8, torch.float32, BLOCK, 6),
    AttentionSpec(AttentionKind.FULL, 2, 1, 8, torch.float32, BLOCK),
]


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64))


def _cached_pool(benefits: list[float]) -> tuple[BlockPool, list]:
    pool = BlockPool(len(benefits) + 2)
    blocks = pool.allocate(len(benefits))
    for i, (block, benefit) in enumerate(zip(blocks, benefits, strict=True)):
        pool.cache(block, b"h%d" % i)
        block.benefit = benefit
    return pool, blocks


def test_uncached_blocks_first_then_least_priority_aged_by_the_clock():
    pool, (a, b, c) = _cached_pool([3.0, 1.0, 2.0])
    (plain,) = pool.allocate(1)  # holds nothing cached
    pool.free([a, b, c, plain])
    assert pool.num_free_blocks == 5 and pool.clock == 0
    # the never-used block and `plain` first (oldest first), then b, c, a by priority
    taken = pool.allocate(3)
    assert taken[2] is b and {taken[0].block_id, taken[1].block_id} == {plain.block_id, 4}
    assert pool.clock == 1.0 and pool.get_cached_block(b"h1") is None
    # a page freed now ranks at clock + benefit: 1 + 1.5 = 2.5, above c (2), below a (3)
    pool.cache(taken[2], b"fresh")
    taken[2].benefit = 1.5
    pool.free([taken[2], taken[0], taken[1]])
    order = [pool.allocate(1)[0] for _ in range(5)]
    assert order[2:] == [c, taken[2], a]  # the uncached two, then by priority
    assert pool.clock == 3.0


def test_rescore_only_raises_a_free_pages_priority():
    pool, (a, b) = _cached_pool([1.0, 2.0])
    pool.free([a, b])
    pool.rescore(a, 5.0)
    pool.rescore(b, 0.0)  # stays at 2: a prefix page never drops below pages scored before
    assert (a.priority, b.priority) == (5.0, 2.0) and b.benefit == 0.0
    pool.allocate(2)  # the never-used blocks
    assert pool.allocate(1)[0] is b


def test_a_checkpoint_is_evicted_whole():
    pool, pages = _cached_pool([1.0, 1.0, 1.0])
    other, _ = pool.allocate(2)
    pool.cache(other, b"other")
    other.benefit = 2.0
    pool.link(pages)
    pool.free([*pages, other])
    assert pool.allocate(1)[0] is pages[0]
    # its other pages hold nothing usable now: uncached, reused before `other`
    assert all(pool.get_cached_block(b"h%d" % i) is None for i in range(3))
    assert pool.allocate(3)[:2] == pages[1:] and pool.get_cached_block(b"other") is None


def test_lru_keeps_the_order_blocks_were_freed():
    pool = BlockPool(4, eviction="lru")
    a, b = pool.allocate(2)
    pool.cache(a, b"a")
    a.benefit = 100.0
    pool.free([a, b])
    assert pool.allocate(3)[2] is a and pool.get_cached_block(b"a") is None  # freed first
    with pytest.raises(ValueError, match="eviction='fifo'"):
        BlockPool(4, eviction="fifo")


@pytest.mark.parametrize("specs", [HYBRID, GEMMA_LIKE])
def test_recompute_cost_is_the_token_by_token_sum(specs):
    cost = RecomputeCost.from_specs(specs)
    for t in (0, 1, 5, 6, 7, 40):
        assert cost(t) == pytest.approx(prefix_cost(specs, t))


def _run(kv: KVCacheManager, request: Request, num_out: int) -> None:
    """Prefill in one step, then `num_out` decode steps (a dummy token each)."""
    assert kv.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    for i in range(num_out):
        request.append_output_token(1 + i)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1


def test_a_deep_prefix_outlives_a_shallow_one_lru_does_the_opposite():
    """Full attention costs more the deeper its block: a long context's blocks are worth
    more per byte than a short one's freed later, which LRU would keep instead."""
    specs = GEMMA_LIKE[1:]
    results = {}
    for eviction in ("benefit", "lru"):
        kv = KVCacheManager(40, BLOCK, True, plan_groups(specs).groups, eviction=eviction,
                            recompute_cost=RecomputeCost.from_specs(specs))
        deep, shallow = _request("deep", list(range(100, 164))), _request("shallow", [7] * 9)
        for request in (deep, shallow):
            _run(kv, request, 0)
            kv.free(request)
        # 24 blocks: the 22 free ones holding nothing (never used, shallow's last), then 2
        cold = _request("cold", [3] * 96)
        assert kv.allocate_slots(cold, 96)
        results[eviction] = [kv.find_cached_prefix(_request("q", r.all_token_ids + [0]))[1]
                             for r in (deep, shallow)]
    assert results["benefit"] == [64, 0]
    assert results["lru"] == [52, 8]  # the least recently freed: deep's last 3 blocks


def test_benefit_keeps_the_prompt_end_checkpoint_lru_evicts():
    """A hybrid request (24-token prompt, 8 output tokens) leaves a checkpoint at its
    prompt end (20 tokens) and at its end (32, rolling). A cold request then takes exactly
    the free pages holding nothing plus the cheapest segment. LRU takes the prompt-end
    checkpoint (the oldest freed page: freed when the prompt was written), leaving the
    attention blocks that are useless without it; benefit eviction takes the last
    segment (8 output tokens' blocks and the rolling checkpoint), so a retry of the
    prompt still hits its 20 tokens."""
    layout = plan_groups(HYBRID)
    hits = {}
    need = None
    for eviction in ("benefit", "lru"):
        kv = KVCacheManager(60, BLOCK, True, layout.groups, CheckpointPolicy(100),
                            eviction=eviction, recompute_cost=RecomputeCost.from_specs(HYBRID))
        first = _request("a", list(range(50, 74)))
        _run(kv, first, 8)
        kv.free(first)
        pool = kv.pool
        assert pool.num_free_blocks == 60
        if need is None:  # the pages holding nothing, and the segment of least priority
            cached = [b for b in pool.free_blocks() if b.block_hash is not None]
            low = min(b.priority for b in cached)
            need = 60 - len(cached) + sum(b.priority == low for b in cached)
            assert sum(b.priority == low for b in cached) == 3 + 3  # 3 blocks + 3 pages
        # a cold request of `need` blocks: its slot (3), one checkpoint (3) and blocks
        num_tokens = BLOCK * (need - 6) - 1
        cold = _request("cold", [200 + i % 50 for i in range(num_tokens)])
        assert kv.allocate_slots(cold, num_tokens)
        assert pool.num_free_blocks == 60 - need == 8  # the prompt's 5 blocks + checkpoint
        hits[eviction] = kv.find_cached_prefix(_request("retry", list(range(50, 74))))[1]
    assert hits == {"benefit": 20, "lru": 0}


def test_reset_prefix_cache_under_benefit_eviction():
    pool, blocks = _cached_pool([1.0, 2.0])
    pool.link(blocks)
    assert not pool.reset_prefix_cache()  # blocks in use
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert pool.num_free_blocks == 4 and pool.get_cached_block(b"h0") is None
    assert len(pool.allocate(4)) == 4 and pool.num_free_blocks == 0
