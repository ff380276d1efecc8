"""Mamba2 references (platforms/ops/mamba2.py) against transformers' own pure-torch Bamba
functions, and against each other: chunked == recurrent, any split of a sequence carrying
the state equals one pass, and the states at requested boundaries are the states of the
prefix up to there (what chunked prefill and prefix-cache checkpoints need)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.bamba import modeling_bamba as hf

from tokenmill.platforms.ops.gated_delta import causal_conv1d
from tokenmill.platforms.ops.mamba2 import (
    Mamba2Dims,
    Mamba2Weights,
    discretize_dt,
    gated_rms_norm,
    mamba2_chunked,
    mamba2_mixer,
    mamba2_recurrent,
    mamba2_state_update,
)

TOL = dict(atol=1e-5, rtol=1e-4)


def _inputs(t: int, h: int = 4, p: int = 8, g: int = 2, n: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, p, generator=gen)
    dt_raw = torch.randn(t, h, generator=gen)
    dt_bias = torch.randn(h, generator=gen) * 0.5
    A = -torch.exp(torch.randn(h, generator=gen) * 0.5)
    B = torch.randn(t, g, n, generator=gen)
    C = torch.randn(t, g, n, generator=gen)
    D = torch.randn(h, generator=gen)
    state = torch.randn(h, p, n, generator=gen) * 0.1
    return x, dt_raw, dt_bias, A, B, C, D, state


@pytest.mark.parametrize("t", [1, 7, 21])
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.1, 1.5)])
def test_chunked_and_recurrent_match_transformers(t, limit):
    x, dt_raw, dt_bias, A, B, C, D, state = _inputs(t)
    want, want_state = hf.mamba2_chunk_scan(
        x[None], dt_raw[None], A, B[None], C[None], chunk_size=8, D=D, dt_bias=dt_bias,
        initial_states=state[None], dt_softplus=True, dt_limit=limit, return_final_states=True,
    )
    dt = discretize_dt(dt_raw, dt_bias, limit)
    got, got_state, none = mamba2_chunked(x, dt, A, B, C, D, state, chunk_size=8)
    assert none.shape == (0, *state.shape)
    torch.testing.assert_close(got, want[0], **TOL)
    torch.testing.assert_close(got_state, want_state[0], **TOL)
    got, got_state = mamba2_recurrent(x, dt, A, B, C, D, state)
    torch.testing.assert_close(got, want[0], **TOL)
    torch.testing.assert_close(got_state, want_state[0], **TOL)


def test_batched_step_matches_transformers_decode():
    s, h, p, g, n = 3, 4, 8, 2, 16
    gen = torch.Generator().manual_seed(3)
    state = torch.randn(s, h, p, n, generator=gen)
    x, dt_raw = torch.randn(s, h, p, generator=gen), torch.randn(s, h, generator=gen)
    B, C = torch.randn(s, g, n, generator=gen), torch.randn(s, g, n, generator=gen)
    A, D, dt_bias = -torch.rand(h, generator=gen) - 0.1, torch.randn(h), torch.randn(h)
    hf_state = state.clone()  # transformers updates its state in place
    want = hf.mamba2_selective_state_update(
        hf_state, x, dt_raw[..., None].expand(-1, -1, p), A[:, None, None].expand(-1, p, n), B, C,
        D[:, None].expand(-1, p), dt_bias=dt_bias[:, None].expand(-1, p), dt_softplus=True,
    )
    before = state.clone()
    got, got_state = mamba2_state_update(state, x, discretize_dt(dt_raw, dt_bias), A, B, C, D)
    torch.testing.assert_close(state, before)  # inputs untouched
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_state, hf_state, **TOL)


@pytest.mark.parametrize("split", [1, 5, 8, 13])
def test_a_split_carrying_the_state_equals_one_pass(split):
    x, dt_raw, dt_bias, A, B, C, D, _ = _inputs(21, seed=1)
    dt = discretize_dt(dt_raw, dt_bias)
    whole, whole_state, _ = mamba2_chunked(x, dt, A, B, C, D, chunk_size=4)
    first, mid, _ = mamba2_chunked(x[:split], dt[:split], A, B[:split], C[:split], D, chunk_size=4)
    rest, end, _ = mamba2_chunked(
        x[split:], dt[split:], A, B[split:], C[split:], D, mid, chunk_size=4
    )
    torch.testing.assert_close(torch.cat((first, rest)), whole, **TOL)
    torch.testing.assert_close(end, whole_state, **TOL)


def test_boundary_states_are_the_prefix_states():
    x, dt_raw, dt_bias, A, B, C, D, state = _inputs(21, seed=2)
    dt = discretize_dt(dt_raw, dt_bias)
    boundaries = [12, 3, 21, 16]  # off the chunk grid, unordered, the end included
    out, final, states = mamba2_chunked(x, dt, A, B, C, D, state, chunk_size=8,
                                        boundaries=boundaries)
    plain, _, _ = mamba2_chunked(x, dt, A, B, C, D, state, chunk_size=8)
    torch.testing.assert_close(out, plain, **TOL)
    for b, got in zip(boundaries, states, strict=True):
        _, want = mamba2_recurrent(x[:b], dt[:b], A, B[:b], C[:b], D, state)
        torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(states[2], final)
    with pytest.raises(ValueError, match=r"\[0, 22\]"):
        mamba2_chunked(x, dt, A, B, C, D, boundaries=[0, 5, 22])


def test_group_mismatch_names_the_counts():
    x, dt_raw, dt_bias, A, B, C, D, _ = _inputs(3, h=4, g=3)
    with pytest.raises(ValueError, match="4 heads are not a multiple of 3"):
        mamba2_chunked(x, discretize_dt(dt_raw, dt_bias), A, B, C, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(dtype):
    gen = torch.Generator().manual_seed(4)
    x, gate = torch.randn(5, 32, generator=gen), torch.randn(5, 32, generator=gen)
    norm = hf.BambaRMSNormGated(32, group_size=16, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=gen))
        want = norm(x.to(dtype), gate.to(dtype))
    got = gated_rms_norm(x.to(dtype), gate.to(dtype), norm.weight.detach(), 1e-5, 16)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, **TOL)
    with pytest.raises(ValueError, match="32 channels are not a multiple of the group size 5"):
        gated_rms_norm(x, gate, norm.weight, 1e-5, 5)


def test_causal_conv1d_with_bias_matches_transformers_prefill_and_decode():
    """The Mamba2 mixer's convolution (bias, silu) is gated_delta.causal_conv1d."""
    gen = torch.Generator().manual_seed(5)
    x, weight, bias = (torch.randn(9, 6, generator=gen), torch.randn(6, 4, generator=gen),
                       torch.randn(6, generator=gen))
    want = hf.causal_conv1d_fn(x.T[None], weight, bias, activation="silu")[0].T
    first, state = causal_conv1d(x[:6], weight, None, bias)
    parts = [first]
    hf_state = x[:6].T[None, :, -3:].clone()
    for t in range(6, 9):
        y, state = causal_conv1d(x[t : t + 1], weight, state, bias)
        hf_y = hf.causal_conv1d_update(x[t : t + 1].T[None], hf_state, weight, bias, "silu")
        torch.testing.assert_close(y, hf_y[0].T, **TOL)
        torch.testing.assert_close(state, hf_state[0])
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts), want, **TOL)


def _hf_mixer(seed: int = 6):
    config = hf.BambaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=4, vocab_size=16,
    )
    torch.manual_seed(seed)
    mixer = hf.BambaMixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.3)
    return mixer


def _ours(mixer, hidden, query_lens, conv0, ssm0, boundaries=None):
    """Our mixer pipeline around `mamba2_mixer` with transformers' mixer's weights."""
    dims = Mamba2Dims(mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size,
                      mixer.conv_kernel_size, mixer.chunk_size, mixer.time_step_limit)
    weights = Mamba2Weights(mixer.conv1d.weight[:, 0], mixer.conv1d.bias, mixer.dt_bias,
                            -torch.exp(mixer.A_log.float()), mixer.D)
    gate, xbc, dt = mixer.in_proj(hidden).split(
        [dims.intermediate_size, dims.conv_dim, dims.num_heads], dim=-1)
    y, results = mamba2_mixer(xbc, dt, query_lens, conv0, ssm0, weights, dims, boundaries)
    y = gated_rms_norm(y, gate, mixer.norm.weight, mixer.norm.variance_epsilon,
                       dims.intermediate_size // dims.num_groups)
    return mixer.out_proj(y), results


@torch.no_grad()
def test_ragged_mixer_with_carried_states_matches_transformers_mixer():
    """Two sequences in one ragged step (one a prefill chunk, one fresh), then both
    continued, one decoding: equal to transformers' mixer over each whole sequence."""
    mixer = _hf_mixer()
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(1, 13, 32, generator=gen), torch.randn(1, 6, 32, generator=gen)
    want_a, want_b = mixer(a)[0], mixer(b)[0]
    out, res = _ours(mixer, torch.cat((a[0, :9], b[0, :5])), [9, 5], [None, None], [None, None],
                     boundaries=[[4, 8], [5]])
    torch.testing.assert_close(out[:9], want_a[:9], **TOL)
    torch.testing.assert_close(out[9:], want_b[:5], **TOL)
    out2, res2 = _ours(mixer, torch.cat((a[0, 9:], b[0, 5:])), [4, 1],
                       [r.conv_state for r in res], [r.ssm_state for r in res])
    torch.testing.assert_close(out2[:4], want_a[9:], **TOL)
    torch.testing.assert_close(out2[4:], want_b[5:], **TOL)
    # a checkpoint restarts the sequence there: tokens 8.. from the state after 8
    out3, _ = _ours(mixer, a[0, 8:], [5], [res[0].boundary_conv_states[1]],
                    [res[0].boundary_ssm_states[1]])
    torch.testing.assert_close(out3, want_a[8:], **TOL)
    # the boundary at the query's end is the final state
    torch.testing.assert_close(res[1].boundary_ssm_states[0], res[1].ssm_state)
    torch.testing.assert_close(res[1].boundary_conv_states[0], res[1].conv_state)
