"""The MLA kind: the core's reference (absorbed == decompressed == dense multi-head
attention over the expanded keys), the KV layout it plans, and the CPU plugin's backend
against the reference (its fast path must be the one that runs)."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill.kv.arena import KVArena
from tokenmill.kv.groups import plan_groups
from tokenmill.model.layers import resolve_backends
from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec, MLADims, kv_cache_shape
from tokenmill.platforms.ops.mla import ReferenceMLABackend, mla_attention
from tokenmill.platforms.ops.reference import ReferenceAttentionBackend
from tokenmill.platforms.registry import PlatformError
from tokenmill_conformance.attention_harness import mixed_batch
from tokenmill_conformance.mla_harness import check_mla_step, make_mla_step, mla_spec
from tokenmill_cpu.mla import CpuMLAAttention

DIMS = MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def _dense(spec, step) -> torch.Tensor:
    """Plain causal multi-head attention over keys/values expanded from every token's
    latent (what transformers' DeepseekV3Attention computes), sequence by sequence."""
    dims, meta = spec.mla, step.metadata
    rank = dims.kv_lora_rank
    flat = step.kv_cache.view(-1, dims.latent_size).clone()
    flat[meta.slot_mapping] = step.latent[:, 0]
    outs = []
    starts = meta.query_start_loc.tolist()
    for i in range(meta.num_seqs):
        seq_len, q_len = meta.seq_lens_cpu[i], meta.query_lens_cpu[i]
        slots = [int(meta.block_tables[i, p // spec.block_size]) * spec.block_size
                 + p % spec.block_size for p in range(seq_len)]
        lat = flat[slots].double()
        k = torch.cat((torch.einsum("kc,hnc->hkn", lat[:, :rank], step.w_uk.double()),
                       lat[:, rank:].expand(spec.num_heads, -1, -1)), dim=-1)
        v = torch.einsum("kc,hvc->hkv", lat[:, :rank], step.w_uv.double())
        q = step.query[starts[i] : starts[i + 1]].double().transpose(0, 1)
        scores = q @ k.transpose(1, 2) * spec.scale
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        outs.append((probs @ v).transpose(0, 1))
    return torch.cat(outs).float()


@pytest.mark.parametrize("absorbed", [True, False, None])
def test_reference_forms_equal_dense_attention(absorbed):
    spec = mla_spec(torch.float32, 8, num_heads=4, dims=DIMS)
    step = make_mla_step(mixed_batch(2), spec, seed=2)
    expected = _dense(spec, step)
    out = mla_attention(spec, step.query, step.latent, None, step.kv_cache.clone(),
                        step.metadata, w_uk=step.w_uk, w_uv=step.w_uv, absorbed=absorbed)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert out.shape == (step.metadata.num_tokens, 4, DIMS.v_head_dim)


def test_reference_rejects_bad_shapes():
    spec = mla_spec(torch.float32, 8, num_heads=4, dims=DIMS)
    step = make_mla_step([(3, 2)], spec)
    with pytest.raises(ValueError, match=r"w_uv has shape \(4, 16, 32\), expected \(4, 12, 32\)"):
        mla_attention(spec, step.query, step.latent, None, step.kv_cache, step.metadata,
                      w_uk=step.w_uk, w_uv=step.w_uk)
    with pytest.raises(ValueError, match="num_kv_heads must be 1"):
        AttentionSpec(AttentionKind.MLA, 4, 4, DIMS.latent_size, torch.float32, 8, mla=DIMS)
    with pytest.raises(ValueError, match="MLA layers, and only they"):
        AttentionSpec(AttentionKind.MLA, 4, 1, DIMS.latent_size, torch.float32, 8)


def test_mla_page_is_latent_rows_and_plans_its_own_group():
    spec = mla_spec(torch.bfloat16, 16, num_heads=128, dims=MLADims(512, 128, 64, 128))
    assert kv_cache_shape(spec, 10) == (10, 16, 576)
    assert KVArena.page_bytes_for(spec) == 16 * 576 * 2  # vs 16 x 2 x 128 x 192 x 2 for MHA
    full = AttentionSpec(AttentionKind.FULL, 4, 1, 288, torch.bfloat16, 16)  # same page bytes
    layout = plan_groups([spec, spec, spec, spec])
    assert [(g.kind, g.layers) for g in layout.groups] == [(AttentionKind.MLA, (0, 1, 2, 3))]
    mixed = plan_groups([full, spec, full, spec])
    assert [g.kind for g in mixed.groups] == [AttentionKind.FULL, AttentionKind.MLA]


def test_arena_views_pages_in_the_backends_declared_shape():
    class Transposed(CpuMLAAttention):
        def kv_cache_shape(self, spec, num_blocks):
            return (spec.block_size, num_blocks, spec.head_size)

    from tokenmill.platforms.interfaces import AllocatorPurpose
    from tokenmill.platforms.kit.host_allocator import HostAllocator

    spec = mla_spec(torch.float32, 4, dims=DIMS)
    allocator = HostAllocator(AllocatorPurpose.KV_ARENA, 1 << 24, "test", owner="test")
    arena = KVArena.create(allocator, [spec, spec], num_blocks=5, device=torch.device("cpu"),
                           backends=[CpuMLAAttention(), Transposed()])
    assert arena.layer_caches[0].shape == (5, 4, DIMS.latent_size)
    assert arena.layer_caches[1].shape == (4, 5, DIMS.latent_size)
    assert arena.page_bytes == 4 * DIMS.latent_size * 4


def test_platform_without_mla_falls_back_to_the_reference_and_says_so(caplog):
    spec = mla_spec(torch.float32, 8, dims=DIMS)

    def choose(s):
        if s.kind != AttentionKind.FULL:
            raise PlatformError(f"no backend for {s.kind.value}")
        return ReferenceAttentionBackend()

    with caplog.at_level(logging.WARNING, logger="tokenmill.model.layers"):
        backends = resolve_backends([spec], choose)
    assert isinstance(backends[0], ReferenceMLABackend)
    assert "no MLA attention backend" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_cpu_backend_matches_the_reference(dtype, block_size):
    backend = CpuMLAAttention()
    spec = mla_spec(dtype, block_size, num_heads=4, dims=DIMS)
    for seed in range(3):
        seqs = mixed_batch(seed) + [(150, 1), (3, 1)]
        check_mla_step(backend, spec, make_mla_step(seqs, spec, seed, poison=True))


def test_cpu_platform_picks_its_own_mla_backend():
    from tokenmill.platforms.registry import load_platform

    active = load_platform("cpu")
    spec = mla_spec(torch.bfloat16, 16, dims=DIMS)
    assert isinstance(active.attention_backend(spec), CpuMLAAttention)


def test_state_pages_beside_mla_pages_name_the_same_bytes():
    """A block id must name the same bytes in every layer view of one arena slot: a
    recurrent layer's state view beside MLA layers is block-major like their latent
    pages (with keys-then-values halves it would scribble over other blocks' latents)."""
    from tokenmill.platforms.interfaces import AllocatorPurpose
    from tokenmill.platforms.kit.host_allocator import HostAllocator
    from tokenmill.platforms.ops.linear_attention import kda_state_spec

    mla = mla_spec(torch.float32, 4, dims=DIMS)
    linear = AttentionSpec(AttentionKind.LINEAR, 2, 2, 16, torch.float32, 4,
                           state=kda_state_spec(2, 16, 4, torch.float32))
    allocator = HostAllocator(AllocatorPurpose.KV_ARENA, 1 << 24, "test", owner="test")
    arena = KVArena.create(allocator, [linear, mla], num_blocks=6, device=torch.device("cpu"),
                           layer_slots=[0, 0])
    arena.buffer.zero_()  # arenas are not zeroed
    state_view, latent_view = arena.layer_caches
    assert state_view.shape == (2, 6, arena.page_bytes // 2)
    state_view[:, 3] = 0xFF  # all of block 3, as the state view sees it
    assert torch.isnan(latent_view[3]).all()  # every byte of block 3's latent page
    assert not torch.isnan(latent_view[[0, 1, 2, 4, 5]]).any()
    full = AttentionSpec(AttentionKind.FULL, 4, 1, 20, torch.float32, 4)
    with pytest.raises(ValueError, match="mixes MLA layers"):
        KVArena.create(allocator, [full, mla], num_blocks=2, device=torch.device("cpu"))
