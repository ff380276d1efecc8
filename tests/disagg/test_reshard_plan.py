"""Resharding's regions (core/kv_connector/handover/reshard.py) moved byte for byte: arenas
of real engines' standard layout ([slot][keys, values][block][token][head][dim]) for every
rank of two tp sizes, cut from one model-wide cache; the regions a decode rank reads,
applied with memmove (what a transport does with them), leave in its pages exactly its
heads of the peer's blocks, move each byte once, and touch nothing else. The handshake
accepts another tp size only where every group's pages can be resharded."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tokenmill.kv_connector.handover.reshard import ReshardPlan
from tokenmill.model.parallel import head_shards
from tokenmill.platforms.kv_handover import (
    ArenaGeometry,
    EngineEndpoint,
    PageShard,
    PullJob,
    RankEndpoint,
    compatibility_problems,
)

SLOTS, BLOCKS, ROWS, DIM = 2, 5, 4, 3  # layer slots, block ids, tokens per block, head size


def _ranks(cache: torch.Tensor, tp: int) -> tuple[list[torch.Tensor], list[RankEndpoint]]:
    """Every rank's arena of `cache` [SLOTS, 2, BLOCKS, ROWS, heads, DIM] float32 at tp
    `tp`, and its endpoint."""
    total = cache.shape[4]
    arenas, ends = [], []
    for r in range(tp):
        s = head_shards(4 * total, total, tp, r)
        part = cache[:, :, :, :, s.kv_head_start:s.kv_head_start + s.num_kv_heads].contiguous()
        arena = part.view(-1).view(torch.uint8)
        page = arena.numel() // (SLOTS * BLOCKS)
        shard = PageShard("heads", ROWS, s.num_kv_heads, DIM * 4, s.kv_head_start, total)
        arenas.append(arena)
        ends.append(RankEndpoint(b"", arena.data_ptr(), ArenaGeometry(BLOCKS, page, SLOTS, 2),
                                 [shard]))
    return arenas, ends


@pytest.mark.parametrize("peer_tp,local_tp,total_heads", [
    (2, 1, 2), (1, 2, 2), (2, 1, 4), (4, 2, 4), (2, 4, 4), (4, 1, 2), (1, 4, 2), (2, 2, 4),
])
def test_regions_place_each_head_once(peer_tp, local_tp, total_heads):
    torch.manual_seed(0)
    peer_cache = torch.randn(SLOTS, 2, BLOCKS, ROWS, total_heads, DIM)
    peer_arenas, peer = _ranks(peer_cache, peer_tp)  # kept alive: the regions read them
    local_arenas, local = _ranks(torch.zeros_like(peer_cache), local_tp)
    pairs = [(1, 3), (4, 0)]
    job = PullJob("r", "peer", pairs, 5.0, [0, 0])
    moved = 0
    for r, end in enumerate(local):
        plan = ReshardPlan(r, end.base_address, end.geometry, end.shards, peer)
        for regions in plan.regions(job).values():
            for dst, src, n in regions:
                ctypes.memmove(dst, src, n)
                moved += n
        s = end.shards[0]
        got = local_arenas[r].view(torch.float32).view(SLOTS, 2, BLOCKS, ROWS, s.heads, DIM)
        want = torch.zeros_like(got)
        for remote_block, local_block in pairs:
            want[:, :, local_block] = peer_cache[:, :, remote_block, :,
                                                 s.head_start:s.head_start + s.heads]
        assert torch.equal(got, want)
    # each pulled block once: its every layer and KV head, as one engine of tp 1 holds it
    whole_block = SLOTS * 2 * ROWS * total_heads * DIM * 4
    replicas = max(1, local_tp // total_heads)  # a head replicated here is read per rank
    assert moved == len(pairs) * whole_block * replicas


def test_replicated_pages_are_read_from_one_rank():
    geometry = ArenaGeometry(BLOCKS, 64, SLOTS, 1)
    peer = [RankEndpoint(b"", 1 << 20, geometry, [PageShard("replicated")]),
            RankEndpoint(b"", 2 << 20, geometry, [PageShard("replicated")])]
    plan = ReshardPlan(0, 4 << 20, geometry, [PageShard("replicated")], peer)
    reads = plan.regions(PullJob("r", "peer", [(2, 1)], 5.0, [0]))
    assert list(reads) == [0]
    assert reads[0] == [((4 << 20) + s * BLOCKS * 64 + 64, (1 << 20) + s * BLOCKS * 64 + 128, 64)
                        for s in range(SLOTS)]


def _endpoint(name: str, tp: int, shards: list[list[PageShard]]) -> EngineEndpoint:
    geometry = ArenaGeometry(BLOCKS, 64, SLOTS, 2)
    return EngineEndpoint(engine_id=name, transport="mooncake", model="m", dtype="float32",
                          block_size=ROWS, layout="L", tensor_parallel_size=tp,
                          ranks=[RankEndpoint(b"", 0, geometry, s) for s in shards])


def _heads(tp: int, total: int = 2, head_bytes: int = DIM * 4) -> list[list[PageShard]]:
    return [[PageShard("heads", ROWS, total // tp, head_bytes, r * total // tp, total)]
            for r in range(tp)]


def test_another_tp_size_is_accepted_when_heads_reshard():
    assert compatibility_problems(_endpoint("a", 1, _heads(1)), _endpoint("b", 2, _heads(2))) == []
    mla = [[PageShard("replicated")]]
    assert compatibility_problems(_endpoint("a", 2, mla * 2), _endpoint("b", 1, mla)) == []


def test_unreshardable_pages_are_refused_naming_the_sizes_and_why():
    fixed = [[PageShard("fixed")]]
    [problem] = compatibility_problems(_endpoint("a", 1, fixed), _endpoint("b", 2, fixed * 2))
    assert problem.startswith("tensor_parallel_size: 2 on b, 1 here: KV group 0 keeps pages "
                              "laid out for one tensor parallel size")
    [problem] = compatibility_problems(_endpoint("a", 1, _heads(1)),
                                       _endpoint("b", 2, _heads(2, head_bytes=8)))
    assert problem == "tensor_parallel_size: 2 on b, 1 here: KV group 0 has head_bytes 8 there, 12 here"
    missing = [_heads(2)[0], _heads(2)[0]]  # both ranks claim heads [0, 1): head 1 nowhere
    [problem] = compatibility_problems(_endpoint("a", 1, _heads(1)), _endpoint("b", 2, missing))
    assert "ranks there hold heads [0], not all 2" in problem
