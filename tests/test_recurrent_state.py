"""Recurrent state in the KV arena: packing over scattered pages, the groups' state
pages, the allocator's slots and checkpoints, and the reference linear backend writing
checkpoints that equal the state at their boundary."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.engine.request import Request
from tokenmill.kv.arena import KVArena
from tokenmill.kv.groups import plan_groups
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv.recurrent import CheckpointPolicy
from tokenmill.platforms.interfaces import (
    AttentionKind,
    AttentionSpec,
    RecurrentStateMetadata,
    recurrent_metadata,
)
from tokenmill.platforms.kit.kv_state import read_states, write_states
from tokenmill.platforms.ops.gated_delta import causal_conv1d, gated_delta_rule_recurrent
from tokenmill.platforms.ops.linear_attention import (
    GatedDeltaInputs,
    ReferenceLinearAttentionBackend,
    gated_delta_state_spec,
    split_qkv,
)
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
HK, HV, DK, DV, K = 1, 2, 8, 4, 4
CONV = 2 * HK * DK + HV * DV
STATE = gated_delta_state_spec(CONV, K, HV, DK, DV, torch.float32)
FULL = AttentionSpec(AttentionKind.FULL, 2, 1, 8, torch.float32, BLOCK)  # 256-byte pages
LINEAR = AttentionSpec(AttentionKind.LINEAR, HV, HK, DK, torch.float32, BLOCK, state=STATE)


class _Heap:
    """A KV allocator over host memory, for arenas in tests."""

    def allocate(self, num_bytes: int) -> torch.Tensor:
        return torch.full((num_bytes,), 0xFF, dtype=torch.uint8)

    def free(self, buffer: torch.Tensor) -> None:
        pass


def test_state_spec_and_groups():
    # conv [24, 3] f32 = 288 B -> 320 aligned, ssm [2, 8, 4] f32 = 256 B: 576 B, 3 pages
    assert STATE.offsets == (0, 320) and STATE.num_bytes == 576
    layout = plan_groups([LINEAR, LINEAR, LINEAR, FULL])
    assert layout.page_bytes == 256 and layout.num_slots == 1
    kinds = [(g.kind, g.state_pages) for g in layout.groups]
    assert kinds == [(AttentionKind.LINEAR, 3)] * 3 + [(AttentionKind.FULL, 0)]


def test_states_pack_over_scattered_pages_and_nothing_else():
    arena = KVArena.create(_Heap(), [LINEAR, FULL], num_blocks=10, device=torch.device("cpu"),
                           layer_slots=[0, 0])
    cache = arena.layer_caches[0]
    assert cache.shape == (2, 10, 128) and cache.dtype == torch.uint8
    before = arena.buffer.clone()
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(2, *t.shape, generator=g) for t in STATE.tensors]
    pages = [[7, 2, 5], [1, 9, 3]]
    write_states(cache, STATE, pages, states)
    for got, want in zip(read_states(cache, STATE, pages), states, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # one sequence alone reads its own; untouched pages keep their bytes
    torch.testing.assert_close(read_states(cache, STATE, [pages[1]])[1][0], states[1][1])
    changed = (arena.buffer != before).view(2, 10, 128).any(dim=2).any(dim=0)
    assert set(changed.nonzero().flatten().tolist()) <= {7, 2, 5, 1, 9, 3}
    # the full-attention layer's view of block 4 is untouched
    assert (arena.layer_caches[1][:, 4].view(torch.uint8) == 0xFF).all()


def _manager(num_blocks=64, interval=2):
    layout = plan_groups([LINEAR, FULL])
    return KVCacheManager(num_blocks, BLOCK, True, layout.groups, CheckpointPolicy(interval))


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def test_slot_checkpoints_and_a_hit_restores_copy_on_extend():
    kv = _manager(interval=2)
    lin = kv.allocators[0]
    tokens = list(range(100, 123))  # 23 tokens: prompt end boundary (22 // 4) * 4 = 20
    r = _request("a", tokens)
    assert kv.allocate_slots(r, 10)  # tokens [0, 10): boundaries 4 (rolling), 8 (kept)
    restore, ckpts = lin.step_ops(r)
    assert restore == [] and [n for n, _ in ckpts] == [8]
    assert len(kv.group_block_ids(r)[0]) == 3  # the slot
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 13)  # [10, 23): 12 rolling -> 16 kept, 20 prompt end
    _, ckpts = lin.step_ops(r)
    assert [n for n, _ in ckpts] == [16, 20]
    r.num_computed_tokens = 23
    kv.free(r)
    assert kv.usage == 0.0
    # a new request with the same first 18 tokens: hit at 16 (checkpoint + 4 full blocks)
    r2 = _request("b", tokens[:18] + [1, 2, 3])
    hit, n = kv.find_cached_prefix(r2)
    assert n == 16
    assert kv.allocate_slots(r2, len(r2.all_token_ids) - n, hit)
    restore, ckpts = lin.step_ops(r2)
    assert restore == [b.block_id for b in hit.tables[0]]
    assert set(restore).isdisjoint(kv.group_block_ids(r2)[0])  # the slot is its own
    # same prompt again: the prompt-end checkpoint gives the longest hit
    r3 = _request("c", tokens)
    assert kv.find_cached_prefix(r3)[1] == 20


def test_rolling_checkpoint_follows_decode_and_stays_at_the_end():
    kv = _manager(interval=100)  # interval checkpoints never: rolling + prompt end only
    lin = kv.allocators[0]
    r = _request("a", list(range(6)))
    assert kv.allocate_slots(r, 6)  # boundary 4: prompt end ((6 - 1) // 4 * 4 = 4), kept
    r.num_computed_tokens = 6
    for step in range(6):  # decode: tokens 6 .. 11 computed
        r.append_output_token(50 + step)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    _, ckpts = lin.step_ops(r)
    assert [n for n, _ in ckpts] == [12]  # the step computing token 11 -> boundary 12
    kv.free(r)
    again = _request("b", r.all_token_ids + [9])
    assert kv.find_cached_prefix(again)[1] == 12
    # the superseded rolling checkpoint at 8 is gone; the kept prompt end is there
    probe = _request("c", r.all_token_ids[:9] + [77])
    assert kv.find_cached_prefix(probe)[1] == 4


def _gd_inputs(t: int, seed: int = 0) -> GatedDeltaInputs:
    g = torch.Generator().manual_seed(seed)
    return GatedDeltaInputs(
        mixed_qkv=torch.randn(t, CONV, generator=g),
        g=-F.softplus(torch.randn(t, HV, generator=g)) * 0.5,
        beta=torch.rand(t, HV, generator=g),
        conv_weight=torch.randn(CONV, K, generator=g),
        conv_bias=None,
        num_k_heads=HK, head_k_dim=DK, num_v_heads=HV, head_v_dim=DV,
    )


def _oracle(inputs: GatedDeltaInputs, upto: int):
    """Output and (conv, ssm) state after the first `upto` tokens, token by token."""
    conv, ssm, outs = None, None, []
    for t in range(upto):
        x, conv = causal_conv1d(inputs.mixed_qkv[t : t + 1], inputs.conv_weight, conv)
        q, k, v = split_qkv(x, inputs)
        out, ssm = gated_delta_rule_recurrent(q, k, v, inputs.g[t : t + 1], inputs.beta[t : t + 1], ssm)
        outs.append(out)
    return torch.cat(outs), conv, ssm


def test_reference_backend_writes_checkpoints_equal_to_the_state_there():
    arena = KVArena.create(_Heap(), [LINEAR], num_blocks=16, device=torch.device("cpu"))
    cache = arena.layer_caches[0]
    backend = ReferenceLinearAttentionBackend()
    inputs = _gd_inputs(11)
    # one sequence, 11 tokens from 0; checkpoints after 4 and 8 tokens
    rec = RecurrentStateMetadata([[3, 9, 1]], [None], [[(4, [5, 6, 7]), (8, [10, 11, 12])]])
    meta = recurrent_metadata([11], [11], rec, BLOCK)
    out = backend.forward(LINEAR, inputs, cache, meta)
    want, conv, ssm = _oracle(inputs, 11)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    for n, pages in ((4, [5, 6, 7]), (8, [10, 11, 12]), (11, [3, 9, 1])):
        _, conv_n, ssm_n = _oracle(inputs, n)
        got_conv, got_ssm = read_states(cache, STATE, [pages])
        torch.testing.assert_close(got_conv[0], conv_n, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got_ssm[0], ssm_n, atol=1e-5, rtol=1e-4)
    # copy on extend: a second sequence continues from the checkpoint at 8 into its own
    # slot, the checkpoint's pages unchanged
    before = cache[:, [10, 11, 12]].clone()
    rest = GatedDeltaInputs(**{**{f: getattr(inputs, f) for f in GatedDeltaInputs.__slots__},
                               "mixed_qkv": inputs.mixed_qkv[8:], "g": inputs.g[8:],
                               "beta": inputs.beta[8:]})
    rec2 = RecurrentStateMetadata([[13, 14, 15]], [[10, 11, 12]], [[]])
    out2 = backend.forward(LINEAR, rest, cache, recurrent_metadata([3], [11], rec2, BLOCK))
    torch.testing.assert_close(out2, want[8:], atol=1e-5, rtol=1e-4)
    assert torch.equal(cache[:, [10, 11, 12]], before)
    torch.testing.assert_close(read_states(cache, STATE, [[13, 14, 15]])[1][0], ssm,
                               atol=1e-5, rtol=1e-4)


def test_a_tier_checkpoint_loads_into_fresh_pages_then_restores_copy_on_extend():
    """KV offload's load of a prefix (core/kv_connector/checkpoints.py): the recurrent
    group takes only fresh pages for the checkpoint at the load's end, published once
    loaded; the first step after reads them and writes its own slot."""
    from tokenmill.kv.manager import PrefixHit

    kv = _manager(interval=100)
    lin = kv.allocators[0]
    r = _request("a", list(range(100, 123)))
    kv.update_block_hashes(r)
    assert kv.allocate_slots(r, 16, PrefixHit(0, [[], []]), publish=False)
    loads = kv.load_block_ids(r)
    assert len(loads[0]) == 3 and len(loads[1]) == 4  # the checkpoint's pages; 4 blocks
    assert kv.group_block_ids(r)[0] == []  # no slot yet
    probe = _request("p", r.all_token_ids)
    assert kv.find_cached_prefix(probe)[1] == 0  # nothing published while loading
    kv.cache_blocks(r, 16)  # the load reported
    assert kv.find_cached_prefix(probe)[1] == 16
    assert [b.block_id for b in kv.find_cached_prefix(probe)[0].tables[0]] == loads[0]
    r.num_computed_tokens = 16
    assert kv.allocate_slots(r, 7)  # [16, 23): the prompt end's checkpoint at 20
    restore, ckpts = lin.step_ops(r)
    slot = kv.group_block_ids(r)[0]
    assert restore == loads[0] and set(slot).isdisjoint(restore)
    assert [n for n, _ in ckpts] == [20]
    # the prompt end's checkpoint is a kept one: saved after the step that writes it
    saves = kv.checkpoint_saves(r)
    assert [b for _, b in saves] == ckpts[0][1]
    assert [k for k, _ in saves] == [lin.key(r.block_hashes[4], p) for p in range(3)]
    # a load that fails: the pages go back unpublished
    f = _request("f", list(range(200, 223)))
    kv.update_block_hashes(f)
    assert kv.allocate_slots(f, 16, PrefixHit(0, [[], []]), publish=False)
    kv.free(f)
    assert kv.find_cached_prefix(_request("q", f.all_token_ids))[1] == 0


def test_a_held_rolling_checkpoint_outlives_its_request_until_released():
    kv = _manager(interval=100)
    r = _request("a", list(range(6)))
    assert kv.allocate_slots(r, 6)
    r.num_computed_tokens = 6
    for step in range(3):  # decode to token 8: the rolling checkpoint at 8
        r.append_output_token(50 + step)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    assert kv.checkpoint_saves(r) == []  # a rolling checkpoint is not saved as it is written
    held = kv.hold_rolling_checkpoints(r)
    assert len(held) == 3 and all(b.block_hash.endswith(b"/g0/s%d" % p) for p, b in enumerate(held))
    kv.free(r)
    assert all(b.ref_cnt == 1 for b in held)
    taken = kv.pool.allocate(kv.pool.num_free_blocks)  # everything else: never the held pages
    assert not {id(b) for b in taken} & {id(b) for b in held}
    kv.pool.free(taken)
    kv.release(held)
    assert all(b.ref_cnt == 0 for b in held) and kv.usage == 0.0
