import pytest

from tokenmill.engine.request import Request
from tokenmill.kv.block_pool import BlockPool
from tokenmill.kv.hashing import hash_block, hash_blocks
from tokenmill.kv.manager import KVCacheManager
from tokenmill.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def test_hash_chain_depends_on_parent_tokens_and_salt():
    a = hash_blocks(list(range(8)), 4)
    b = hash_blocks([0, 1, 2, 3, 9, 5, 6, 7], 4)
    assert a[0] == b[0] and a[1] != b[1]
    assert hash_blocks(list(range(8)), 4, (("salt", "x"),))[1] != a[1]
    assert hash_block(None, [1, 2]) != hash_block(a[0], [1, 2])
    # incremental hashing continues the chain exactly
    assert hash_blocks(list(range(12)), 4, start=2, parent=a[1]) == hash_blocks(list(range(12)), 4)[2:]


def test_allocate_free_refcounts_and_lru_order():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.num_free_blocks == 2 and a.ref_cnt == 1
    pool.touch([a])
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free([b, a])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([a])
    with pytest.raises(RuntimeError, match="only 4 free"):
        pool.allocate(5)


def test_cached_block_survives_free_until_reused():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, b"h")
    pool.free([a])
    assert pool.get_cached_block(b"h") is a  # still findable while free
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([a])
    pool.allocate(2)  # reuse evicts
    assert pool.get_cached_block(b"h") is None


def test_manager_prefix_hit_leaves_one_token_and_counts():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    r1 = make_request("a", list(range(10)))
    hits, n = kv.find_cached_prefix(r1)
    assert n == 0 and kv.allocate_slots(r1, 10, hits)
    assert len(kv.block_ids(r1)) == 3
    r2 = make_request("b", list(range(8)) + [99, 98])
    hits, n = kv.find_cached_prefix(r2)
    assert n == 8 and [b.block_id for b in hits.tables[0]] == kv.block_ids(r1)[:2]
    # a prompt that is exactly cached still leaves its last token to compute
    r3 = make_request("c", list(range(8)))
    assert kv.find_cached_prefix(r3)[1] == 4
    # salts isolate tenants
    assert kv.find_cached_prefix(make_request("d", list(range(10)), salt="s"))[1] == 0


def test_manager_refuses_without_side_effects_when_full():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make_request("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.block_ids(r) == [] and kv.pool.num_free_blocks == 2
    assert kv.allocate_slots(r, 8)
    kv.free(r)
    assert kv.pool.num_free_blocks == 2 and kv.usage == 0.0


def test_free_hit_blocks_count_against_capacity():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r1 = make_request("a", list(range(9)))
    assert kv.allocate_slots(r1, 9)
    kv.free(r1)  # 3 blocks free, first two cached
    r2 = make_request("b", list(range(8)) + [7, 7, 7, 7, 7])
    hits, n = kv.find_cached_prefix(r2)
    assert n == 8
    # needs 2 hit blocks + 2 fresh = 4 > 3
    assert not kv.allocate_slots(r2, 5, hits)
    assert all(b.ref_cnt == 0 for b in hits.blocks())


def test_stale_hits_are_refused_loudly():
    """Hits looked up before another allocation may name a block that allocation took."""
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r1 = make_request("a", list(range(5)))
    assert kv.allocate_slots(r1, 5)
    kv.free(r1)  # free queue: [block 1, block 0 (cached)]
    r2 = make_request("b", list(range(4)) + [9])
    hits, n = kv.find_cached_prefix(r2)
    assert n == 4
    cold = make_request("c", [7] * 8)
    assert kv.allocate_slots(cold, 8)  # takes both blocks, the hit among them
    with pytest.raises(RuntimeError, match="stale prefix-cache hits for request 'b'"):
        kv.allocate_slots(r2, 1, hits)
    assert kv.block_ids(r2) == []
    kv.free(cold)
    # hits only start a request
    fresh_hits, _ = kv.find_cached_prefix(make_request("d", [7] * 5))
    r3 = make_request("e", [7] * 5)
    assert kv.allocate_slots(r3, 1)
    with pytest.raises(RuntimeError, match="already holds KV"):
        kv.allocate_slots(r3, 1, fresh_hits)
