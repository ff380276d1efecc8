"""Resharding's regions (core/kv_connector/handover/reshard.py) moved byte for byte: arenas
of real engines' standard layout ([slot][keys, values][block][token][head][dim]) for every
rank of two tp sizes, cut from one model-wide cache; the regions a decode rank reads,
applied with memmove (what a transport does with them), leave in its pages exactly its
heads of the peer's blocks, move each byte once, and touch nothing else; recurrent states
packed by the real packer (kv_state.py) come out, unpacked, as the rank's rows of every
run. The handshake accepts another tp size only where every group's pages reshard."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from tokenmill.kv_connector.handover.reshard import ReshardPlan, page_shards, rank_state
from tokenmill.model.families.bamba import FAMILY as BAMBA
from tokenmill.model.families.kimi_linear import FAMILY as KIMI_LINEAR
from tokenmill.model.family import shrink_config
from tokenmill.model.mamba2 import _shares
from tokenmill.model.parallel import head_shards
from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec, RecurrentStateSpec
from tokenmill.platforms.kit.kv_state import read_states, write_states
from tokenmill.platforms.kv_handover import (
    ArenaGeometry,
    EngineEndpoint,
    PageShard,
    PullJob,
    RankEndpoint,
    compatibility_problems,
)
from tokenmill.platforms.ops.linear_attention import gated_delta_state_spec, kda_state_spec
from tokenmill.platforms.ops.mamba2 import Mamba2Dims, mamba2_state_spec
from tokenmill_conformance.tiny_models import make_config

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
    job = PullJob("r", "peer", [(2, 1)], 5.0, [0])
    plan = ReshardPlan(0, 4 << 20, geometry, [PageShard("replicated")], peer)
    reads = plan.regions(job)
    assert list(reads) == [0]
    assert reads[0] == [((4 << 20) + s * BLOCKS * 64 + 64, (1 << 20) + s * BLOCKS * 64 + 128, 64)
                        for s in range(SLOTS)]
    assert plan.shared_blocks(job) == []  # tp 1 here: nothing to share


def test_replicated_pages_are_read_once_by_rank_0_and_shared():
    """tp 1 -> tp 2: our rank 0 reads an MLA page from the peer, rank 1 reads none; both
    name the block rank 0 then broadcasts over the TP group (worker_side.py)."""
    geometry = ArenaGeometry(BLOCKS, 64, SLOTS, 2)
    peer = [RankEndpoint(b"", 1 << 20, geometry, [PageShard("replicated")])]
    job = PullJob("r", "peer", [(2, 1)], 5.0, [0])
    plans = [ReshardPlan(r, (4 + r) << 20, geometry, [PageShard("replicated")], peer, tp=2)
             for r in (0, 1)]
    assert plans[0].regions(job) == {0: [
        ((4 << 20) + s * BLOCKS * 64 + h * BLOCKS * 32 + 32,
         (1 << 20) + s * BLOCKS * 64 + h * BLOCKS * 32 + 64, 32)
        for s in range(SLOTS) for h in range(2)]}
    assert plans[1].regions(job) == {}
    assert [p.shared_blocks(job) for p in plans] == [[1], [1]]


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


# ---- Mamba2 (bamba) and KDA (kimi_linear): each rank's rows as the model code cuts them


def _mamba2_dims(groups: int, heads: int = 8) -> Mamba2Dims:
    return Mamba2Dims(num_heads=heads, head_dim=4, num_groups=groups, state_size=8,
                      conv_kernel=4, chunk_size=8)


def _mamba2_split(dims: Mamba2Dims):
    """Rank r of tp's Mamba2 state, cut from the whole one [1, rows, ...] by the mixer's
    own shard rules (core/model/mamba2.py `_shares`: the conv's x, B, C channel pieces,
    the heads' slice), not by the spec's `parts`."""
    def split(whole: list[torch.Tensor], tp: int, rank: int) -> list[torch.Tensor]:
        local = dataclasses.replace(dims, num_heads=dims.num_heads // tp,
                                    num_groups=dims.num_groups // tp)
        _, conv, _, heads = _shares(local, rank, tp)
        channels = torch.cat([whole[0][:, s.start:s.start + s.length] for s in conv.slices], 1)
        return [channels, whole[1][:, heads.start:heads.start + heads.length]]
    return split


def _kda_split(heads: int, dim: int):
    """Rank r of tp's KDA state as KimiDeltaAttention shards it: its heads' channels of
    each of the q, k, v convs, its heads of the delta-rule state."""
    def split(whole: list[torch.Tensor], tp: int, rank: int) -> list[torch.Tensor]:
        size, n = heads * dim, heads // tp
        conv = torch.cat([whole[0][:, j * size + rank * n * dim:j * size + (rank + 1) * n * dim]
                          for j in range(3)], 1)
        return [conv, whole[1][:, rank * n:(rank + 1) * n]]
    return split


STATES = {
    # Mamba2 with one B/C group per rank at tp 2, and two; the conv state in bf16
    "mamba2_groups2": (mamba2_state_spec(_mamba2_dims(2), torch.bfloat16),
                       _mamba2_split(_mamba2_dims(2))),
    "mamba2_groups4": (mamba2_state_spec(_mamba2_dims(4), torch.float32),
                       _mamba2_split(_mamba2_dims(4))),
    "kda": (kda_state_spec(2, 16, 4, torch.float32), _kda_split(2, 16)),
}


def _family_state_ranks(spec, split, whole, tp: int, pages: list[int]):
    """As `_state_ranks` for `spec`, each rank's share cut by `split`; pages sized so the
    rank's packed state fills most of STATE_PAGES pages (a state crosses page halves)."""
    mine = rank_state(spec, tp)
    page = 2 * -(-mine.num_bytes // (2 * STATE_PAGES))
    arenas, ends, views = [], [], []
    for r in range(tp):
        arena = torch.zeros(SLOTS * BLOCKS * page, dtype=torch.uint8)
        caches = [arena[s * BLOCKS * page:(s + 1) * BLOCKS * page].view(2, BLOCKS, page // 2)
                  for s in range(SLOTS)]
        if whole is not None:
            for s, cache in enumerate(caches):
                write_states(cache, mine, [pages], split([w + s for w in whole], tp, r))
        arenas.append(arena)
        views.append(caches)
        ends.append(RankEndpoint(b"", arena.data_ptr(), ArenaGeometry(BLOCKS, page, SLOTS, 2),
                                 [PageShard("state")]))
    return arenas, ends, views


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("peer_tp,local_tp", [(2, 1), (1, 2)])
def test_mamba2_and_kda_states_reshard_as_the_model_splits_them(state, peer_tp, local_tp):
    """A state packed by the tp 2 ranks (each cut by the model's own shard rules) lands,
    byte for byte, as the state a tp 1 rank holds, and the reverse; each row moved once."""
    spec, split = STATES[state]
    torch.manual_seed(0)
    whole = [torch.randn(1, *t.shape).to(t.dtype) for t in spec.tensors]
    peer_pages, local_pages = [4, 0, 2, 1], [3, 1, 4, 0]
    peer_arenas, peer, _ = _family_state_ranks(spec, split, whole, peer_tp, peer_pages)
    local_arenas, local, views = _family_state_ranks(spec, split, None, local_tp, local_pages)
    job = PullJob("r", "peer", list(zip(peer_pages, local_pages, strict=True)), 5.0,
                  [0] * STATE_PAGES)
    moved = 0
    for r, end in enumerate(local):
        plan = ReshardPlan(r, end.base_address, end.geometry, end.shards, peer, [spec], local_tp)
        for regions in plan.regions(job).values():
            for dst, src, n in regions:
                ctypes.memmove(dst, src, n)
                moved += n
        mine = rank_state(spec, local_tp)
        for s, cache in enumerate(views[r]):
            got = read_states(cache, mine, [local_pages])
            want = split([w + s for w in whole], local_tp, r)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a.view(torch.uint8), b.to(a.dtype).view(torch.uint8))
    assert moved == SLOTS * sum(t.num_bytes for t in spec.tensors)


@pytest.mark.parametrize("arch", ["bamba", "kimi_linear"])
def test_the_declared_runs_give_each_rank_the_state_its_model_builds(arch):
    """rank_state(the whole model's spec, tp) is the spec the model builds at tp's rank
    shapes, so both sides of a handover agree on every rank's layout (page_shards marks
    the group "state", not "fixed")."""
    family = {"bamba": BAMBA, "kimi_linear": KIMI_LINEAR}[arch]
    config = make_config(arch, 300)
    [whole] = {s.state for s in family.attention_specs(config, torch.float32, 4) if s.state}
    assert all(t.parts for t in whole.tensors)
    for tp in (1, 2):
        local_specs = family.attention_specs(family.local_config(config, tp), torch.float32, 4)
        assert {s.state for s in local_specs if s.state} == {rank_state(whole, tp)}


def test_mamba2_with_fewer_groups_than_ranks_is_refused_by_the_model():
    """One B/C group at tp 2 would replicate the group's B and C channels on every rank;
    the mixer does not build that layout (its gated norm spans the group's heads across
    ranks), so no engine holds a replicated run and a handover never meets one."""
    config = shrink_config(make_config("bamba", 300), mamba_n_groups=1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the "
                                         "model's Mamba2 groups 1"):
        BAMBA.local_config(config, 2)


def test_a_state_that_does_not_split_is_fixed_and_says_why(caplog):
    """page_shards marks a LINEAR group "fixed", naming the variant and tp, where the
    state declares no runs, or where this rank's state is not their split (a backend's
    own layout); the handshake then refuses another tp size for it."""
    def linear(state):
        return AttentionSpec(AttentionKind.LINEAR, 8, 2, 8, torch.float32, 4, state=state)

    spec = mamba2_state_spec(_mamba2_dims(2), torch.float32)
    bare = RecurrentStateSpec("mamba2", tuple(dataclasses.replace(t, parts=())
                                              for t in spec.tensors))
    caplog.set_level("INFO", logger="tokenmill.kv_connector.handover.reshard")
    [shard] = page_shards([0], [linear(bare)], [linear(rank_state(spec, 2))], None, 2, 0, 64)
    assert shard.kind == "fixed"
    assert "a mamba2 state whose tensor parallel runs are not declared or do not split " \
           "over 2 ranks" in caplog.text
    other = rank_state(kda_state_spec(2, 16, 4, torch.float32), 2)
    [shard] = page_shards([0], [linear(spec)], [linear(other)], None, 2, 0, 64)
    assert shard.kind == "fixed"
    assert "a kda state laid out otherwise than its declared runs split over 2 ranks" \
        in caplog.text
    [shard] = page_shards([0], [linear(spec)], [linear(rank_state(spec, 2))], None, 2, 1, 64)
    assert shard == PageShard("state")
