"""Resharding's regions (core/kv_connector/handover/reshard.py) moved byte for byte: arenas
of real engines' standard layout ([slot][keys, values][block][token][head][dim]) for every
rank of two tp sizes, cut from one model-wide cache; the regions a decode rank reads,
applied with memmove (what a transport does with them), leave in its pages exactly its
heads of the peer's blocks, move each byte once, and touch nothing else; recurrent states
packed by the real packer (kv_state.py) come out, unpacked, as the rank's rows of every
run. The handshake accepts another tp size only where every group's pages reshard."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tokenmill.kv_connector.handover.reshard import ReshardPlan, rank_state
from tokenmill.model.parallel import head_shards
from tokenmill.platforms.kit.kv_state import read_states, write_states
from tokenmill.platforms.kv_handover import (
    ArenaGeometry,
    EngineEndpoint,
    PageShard,
    PullJob,
    RankEndpoint,
    compatibility_problems,
)
from tokenmill.platforms.ops.linear_attention import gated_delta_state_spec

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


# a Gated DeltaNet state (qwen3_next's shape at tiny size): conv channels q | k | v, value
# heads; 3200 bytes packed, 4 pages of 1024 / tp bytes at every tp size here
WHOLE_STATE = gated_delta_state_spec(96, 4, 4, 16, 8, torch.float32, conv_parts=(32, 32, 32))
STATE_PAGES = 4


def _rank_tensors(whole: list[torch.Tensor], tp: int, rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s share of each whole state tensor [1, rows, ...]: its rows of every run."""
    out = []
    for t, value in zip(WHOLE_STATE.tensors, whole, strict=True):
        rows, start = [], 0
        for part in t.parts:
            n = part // tp
            rows.append(value[:, start + rank * n:start + (rank + 1) * n])
            start += part
        out.append(torch.cat(rows, dim=1))
    return out


def _state_ranks(whole: list[torch.Tensor] | None, tp: int, pages: list[int]):
    """Every rank's arena ([SLOTS] regions of [2, BLOCKS, half] bytes) with `whole`'s share
    packed into `pages` of every slot (zeros when None), its endpoint and its layer views."""
    page = 1024 // tp
    arenas, ends, views = [], [], []
    for r in range(tp):
        arena = torch.zeros(SLOTS * BLOCKS * page, dtype=torch.uint8)
        caches = [arena[s * BLOCKS * page:(s + 1) * BLOCKS * page].view(2, BLOCKS, page // 2)
                  for s in range(SLOTS)]
        if whole is not None:
            for s, cache in enumerate(caches):  # a different state per slot (layer)
                write_states(cache, rank_state(WHOLE_STATE, tp), [pages],
                             _rank_tensors([w + s for w in whole], tp, r))
        arenas.append(arena)
        views.append(caches)
        ends.append(RankEndpoint(b"", arena.data_ptr(), ArenaGeometry(BLOCKS, page, SLOTS, 2),
                                 [PageShard("state")]))
    return arenas, ends, views


@pytest.mark.parametrize("peer_tp,local_tp", [(2, 1), (1, 2), (4, 2), (2, 4), (1, 4), (2, 2)])
def test_recurrent_states_reshard_row_by_row(peer_tp, local_tp):
    torch.manual_seed(0)
    whole = [torch.randn(1, *t.shape) for t in WHOLE_STATE.tensors]
    peer_pages, local_pages = [4, 0, 2, 1], [3, 1, 4, 0]
    peer_arenas, peer, _ = _state_ranks(whole, peer_tp, peer_pages)
    local_arenas, local, views = _state_ranks(None, local_tp, local_pages)
    job = PullJob("r", "peer", list(zip(peer_pages, local_pages, strict=True)), 5.0,
                  [0] * STATE_PAGES)
    moved = 0
    for r, end in enumerate(local):
        plan = ReshardPlan(r, end.base_address, end.geometry, end.shards, peer, [WHOLE_STATE],
                           local_tp)
        for regions in plan.regions(job).values():
            for dst, src, n in regions:
                ctypes.memmove(dst, src, n)
                moved += n
        for s, cache in enumerate(views[r]):
            got = read_states(cache, rank_state(WHOLE_STATE, local_tp), [local_pages])
            want = _rank_tensors([w + s for w in whole], local_tp, r)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # every row once: the whole state's tensors in every slot, no alignment padding
    assert moved == SLOTS * sum(t.num_bytes for t in WHOLE_STATE.tensors)


def test_a_state_without_declared_parts_is_fixed():
    spec = gated_delta_state_spec(96, 4, 4, 16, 8, torch.float32)  # no conv_parts
    assert rank_state(spec, 2) is None
    assert rank_state(WHOLE_STATE, 1) == WHOLE_STATE
