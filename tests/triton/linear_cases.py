"""The Triton LINEAR backend (tokenmill_triton.linear_attention) against the core's
reference backend on the same arena pages, for each variant it declares (gated_delta, kda,
mamba2): a step mixing a fresh prompt with checkpoints inside and at its end, a
continuation from a prefix-cache checkpoint (copy on extend) and a decode; then an
all-decode step (the recurrence kernels). Outputs, final states, checkpoint states and the
untouched source pages must match. And the nvidia plugin's platform hands each variant's
layers to this backend, not to the core's reference. Run by test_triton_kernels.py in a
fresh process (TRITON_INTERPRET=1 without a GPU)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kv.arena import KVArena
from tokenmill.model.layers import resolve_backends
from tokenmill.platforms.interfaces import (
    AttentionKind,
    AttentionSpec,
    RecurrentStateMetadata,
    recurrent_metadata,
)
from tokenmill.platforms.kit.kv_state import read_states
from tokenmill.platforms.ops.linear_attention import (
    GatedDeltaInputs,
    KDAInputs,
    ReferenceLinearAttentionBackend,
    gated_delta_state_spec,
    kda_state_spec,
)
from tokenmill.platforms.ops.mamba2 import (
    Mamba2Dims,
    Mamba2Inputs,
    Mamba2Weights,
    mamba2_state_spec,
)
from tokenmill.platforms.registry import load_platform
from tokenmill_triton.configs import KernelConfigs, LinearAttentionConfig, interpreter_mode
from tokenmill_triton.linear_attention import TritonLinearAttention

DEVICE = torch.device("cpu" if interpreter_mode() else "cuda")
CONFIGS = KernelConfigs(linear=LinearAttentionConfig(chunk_size=16, block_v=16,
                                                     conv_block_c=32, conv_block_t=8))
BLOCK = 4
HK, HV, DK, DV, K = 1, 2, 16, 8, 4
CONV = 2 * HK * DK + HV * DV
STATE = gated_delta_state_spec(CONV, K, HV, DK, DV, torch.float32)
LINEAR = AttentionSpec(AttentionKind.LINEAR, HV, HK, DK, torch.float32, BLOCK, state=STATE)
KDA_H, KDA_D = 2, 16
KDA = AttentionSpec(AttentionKind.LINEAR, KDA_H, KDA_H, KDA_D, torch.float32, BLOCK,
                    state=kda_state_spec(KDA_H, KDA_D, K, torch.float32))
DIMS = Mamba2Dims(num_heads=4, head_dim=8, num_groups=2, state_size=16, conv_kernel=K,
                  chunk_size=8)
MAMBA2 = AttentionSpec(AttentionKind.LINEAR, DIMS.num_heads, DIMS.num_groups, DIMS.state_size,
                       torch.float32, BLOCK, state=mamba2_state_spec(DIMS, torch.float32))
SPECS = {"gated_delta": LINEAR, "kda": KDA, "mamba2": MAMBA2}


class _Heap:
    def allocate(self, num_bytes: int) -> torch.Tensor:
        return torch.full((num_bytes,), 0x7F, dtype=torch.uint8, device=DEVICE)

    def free(self, buffer: torch.Tensor) -> None:
        pass


def _inputs(variant: str, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if variant == "kda":
        c = 3 * KDA_H * KDA_D
        return KDAInputs(
            mixed_qkv=torch.randn(t, c, generator=g).to(DEVICE),
            g=(-F.softplus(torch.randn(t, KDA_H, KDA_D, generator=g)) * 0.5).to(DEVICE),
            beta=torch.rand(t, KDA_H, generator=g).to(DEVICE),
            conv_weight=torch.randn(c, K, generator=g).to(DEVICE),
            num_heads=KDA_H, head_dim=KDA_D,
        )
    if variant == "mamba2":
        weights = Mamba2Weights(
            conv_weight=torch.randn(DIMS.conv_dim, K, generator=g).to(DEVICE),
            conv_bias=torch.randn(DIMS.conv_dim, generator=g).to(DEVICE),
            dt_bias=torch.randn(DIMS.num_heads, generator=g).to(DEVICE),
            A=(-torch.rand(DIMS.num_heads, generator=g) - 0.2).to(DEVICE),
            D=torch.randn(DIMS.num_heads, generator=g).to(DEVICE),
        )
        return Mamba2Inputs(torch.randn(t, DIMS.conv_dim, generator=g).to(DEVICE),
                            torch.randn(t, DIMS.num_heads, generator=g).to(DEVICE), weights, DIMS)
    return GatedDeltaInputs(
        mixed_qkv=torch.randn(t, CONV, generator=g).to(DEVICE),
        g=(-F.softplus(torch.randn(t, HV, generator=g)) * 0.5).to(DEVICE),
        beta=torch.rand(t, HV, generator=g).to(DEVICE),
        conv_weight=torch.randn(CONV, K, generator=g).to(DEVICE),
        conv_bias=torch.randn(CONV, generator=g).to(DEVICE),
        num_k_heads=HK, head_k_dim=DK, num_v_heads=HV, head_v_dim=DV,
    )


def _random_states(cache, block_ids, seed):
    g = torch.Generator().manual_seed(seed)
    for ids in block_ids:
        cache[:, ids] = torch.randint(0, 60, cache[:, ids].shape, generator=g,
                                      dtype=torch.uint8).to(DEVICE)  # small finite floats


def _run_both(variant, rec, query_lens, seq_lens, seed):
    spec = SPECS[variant]
    inputs = _inputs(variant, sum(query_lens), seed)
    arena = KVArena.create(_Heap(), [spec], num_blocks=40, device=DEVICE)
    cache = arena.layer_caches[0]
    sources = [s for s in rec.source_block_ids if s is not None]
    _random_states(cache, sources + rec.state_block_ids, seed)
    ref_cache = cache.clone()
    foreign = [s for s, own in zip(rec.source_block_ids, rec.state_block_ids)
               if s is not None and s != own]  # checkpoints read, never written
    before = [cache[:, ids].clone() for ids in foreign]
    meta = recurrent_metadata(query_lens, seq_lens, rec, BLOCK, device=DEVICE)
    got = TritonLinearAttention(CONFIGS, "test").forward(spec, inputs, cache, meta)
    want = ReferenceLinearAttentionBackend().forward(spec, inputs, ref_cache, meta)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-4)
    # every page the step wrote (states, checkpoints) equal as values
    for ids in rec.state_block_ids + [p for marks in rec.checkpoints for _, p in marks]:
        for a, b in zip(read_states(cache, spec.state, [ids]),
                        read_states(ref_cache, spec.state, [ids])):
            torch.testing.assert_close(a, b, atol=3e-5, rtol=3e-4)
    for ids, pages in zip(foreign, before):
        assert torch.equal(cache[:, ids], pages), f"the source pages {ids} were written"


@pytest.mark.parametrize("variant", sorted(SPECS))
def test_mixed_step_with_checkpoints_and_a_prefix_hit_matches_the_reference(variant):
    # seq 0: fresh 21-token prompt, checkpoints after 4, 16 and 21 (its end);
    # seq 1: 6 tokens after a hit, continuing from a checkpoint's pages into its own slot;
    # seq 2: one decode token from its slot
    rec = RecurrentStateMetadata(
        state_block_ids=[[1, 2, 3], [4, 5, 6], [7, 8, 9]],
        source_block_ids=[None, [10, 11, 12], [7, 8, 9]],
        checkpoints=[[(4, [13, 14, 15]), (16, [16, 17, 18]), (21, [19, 20, 21])],
                     [(6, [22, 23, 24])], []],
    )
    _run_both(variant, rec, [21, 6, 1], [21, 14, 30], seed=2)


@pytest.mark.parametrize("variant", sorted(SPECS))
def test_decode_step_runs_the_recurrence_and_matches_the_reference(variant):
    rec = RecurrentStateMetadata([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[1, 2, 3], None, [7, 8, 9]],
                                 [[], [(1, [10, 11, 12])], []])
    _run_both(variant, rec, [1, 1, 1], [9, 1, 40], seed=4)


def test_the_plugin_runs_every_variant_on_triton(caplog):
    """The fast path runs where it should: the nvidia platform's backend for each variant's
    layers is the Triton one, and the core logs no fallback to its reference."""
    active = load_platform("nvidia")
    specs = list(SPECS.values())
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        chosen = resolve_backends(specs, active.attention_backend)
    assert [type(b) for b in chosen] == [TritonLinearAttention] * len(specs)
    assert "reference" not in caplog.text, caplog.text
    unknown = dataclasses.replace(
        LINEAR, state=dataclasses.replace(STATE, variant="retnet"))
    with pytest.raises(ValueError, match="not 'retnet'"):
        chosen[0].forward(unknown, None, None, None)
