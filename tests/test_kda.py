"""Kimi Delta Attention references (platforms/ops/kda.py) against transformers' torch path
(`recurrent_kimi_delta_attention`, `chunk_kimi_delta_attention`) and each other: chunked
equals recurrent, and splitting a sequence anywhere while carrying the state changes
nothing (what chunked prefill and prefix-cache checkpoints rely on)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kda

from tokenmill.platforms.ops.kda import kda_chunked, kda_recurrent

H, DK, DV = 3, 16, 8


def _inputs(t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, H, DK, generator=gen)
    k = torch.randn(t, H, DK, generator=gen)
    v = torch.randn(t, H, DV, generator=gen)
    # per-channel log decay, some channels fast (-3) and some nearly kept (-0.01)
    g = -torch.rand(t, H, DK, generator=gen).pow(3) * 3 - 0.01
    beta = torch.rand(t, H, generator=gen)
    state = torch.randn(H, DK, DV, generator=gen) * 0.3
    return q, k, v, g, beta, state


def _hf(fn, q, k, v, g, beta, state, **kw):
    out, final = fn(q[None], k[None], v[None], g=g[None], beta=beta[None],
                    initial_state=state[None], output_final_state=True,
                    use_qk_l2norm_in_kernel=True, **kw)
    return out[0], final[0]


@pytest.mark.parametrize("t", [1, 5, 64, 100])
def test_recurrent_and_chunked_equal_transformers(t):
    q, k, v, g, beta, state = _inputs(t, seed=t)
    want_out, want_state = _hf(hf_kda.recurrent_kimi_delta_attention, q, k, v, g, beta, state)
    out, final = kda_recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-5)
    hf_out, hf_state = _hf(hf_kda.chunk_kimi_delta_attention, q, k, v, g, beta, state,
                           chunk_size=16)
    out, final = kda_chunked(q, k, v, g, beta, state, chunk_size=16)
    torch.testing.assert_close(out, hf_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, want_state, atol=1e-4, rtol=1e-4)


def test_split_anywhere_carrying_the_state():
    q, k, v, g, beta, _ = _inputs(70, seed=3)
    whole, whole_state = kda_chunked(q, k, v, g, beta, chunk_size=32)
    a, state = kda_chunked(q[:23], k[:23], v[:23], g[:23], beta[:23], chunk_size=32)
    b, state = kda_recurrent(q[23:24], k[23:24], v[23:24], g[23:24], beta[23:24], state)
    c, state = kda_chunked(q[24:], k[24:], v[24:], g[24:], beta[24:], state, chunk_size=8)
    torch.testing.assert_close(torch.cat((a, b, c)), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, whole_state, atol=1e-4, rtol=1e-4)


def test_a_per_token_decay_is_gated_deltanet():
    from tokenmill.platforms.ops.gated_delta import gated_delta_rule_recurrent

    q, k, v, g, beta, state = _inputs(9, seed=4)
    g_head = g[..., 0]
    out, final = kda_recurrent(q, k, v, g_head[..., None].expand(-1, -1, DK), beta, state)
    want, want_state = gated_delta_rule_recurrent(q, k, v, g_head, beta, state)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(final, want_state)


def test_decay_must_be_per_channel():
    q, k, v, g, beta, _ = _inputs(4, seed=5)
    with pytest.raises(ValueError, match=r"per key channel, \[T, H, dk\]"):
        kda_recurrent(q, k, v, g[..., 0], beta)
