"""Gated DeltaNet references (platforms/ops/gated_delta.py) against transformers' own pure-torch
Qwen3-Next functions, and against each other: chunked == recurrent, and any split of a
sequence carrying the state equals one pass (what chunked prefill and checkpoints need)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from tokenmill.platforms.ops.gated_delta import (
    causal_conv1d,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)


def _inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hk, dk, generator=g)
    k = torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(t, hv, generator=g)) * 0.5
    beta = torch.rand(t, hv, generator=g)
    state = torch.randn(hv, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("t", [1, 7, 21])
def test_matches_transformers(t):
    q, k, v, decay, beta, state = _inputs(t)
    want, want_state = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], decay[None], beta[None], chunk_size=8,
        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    for fn, kw in ((gated_delta_rule_chunked, {"chunk_size": 8}), (gated_delta_rule_recurrent, {})):
        got, got_state = fn(q, k, v, decay, beta, state, **kw)
        torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got_state, want_state[0], atol=1e-5, rtol=1e-4)


def test_recurrence_matches_transformers_decode():
    q, k, v, decay, beta, state = _inputs(1, hk=2, hv=2)
    want, want_state = hf.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], decay[None], beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    got, got_state = gated_delta_rule_recurrent(q, k, v, decay, beta, state)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("split", [1, 5, 8, 13])
def test_a_split_carrying_the_state_equals_one_pass(split):
    q, k, v, decay, beta, _ = _inputs(21, seed=1)
    whole, whole_state = gated_delta_rule_chunked(q, k, v, decay, beta, chunk_size=4)
    first, mid_state = gated_delta_rule_chunked(
        q[:split], k[:split], v[:split], decay[:split], beta[:split], chunk_size=4
    )
    rest, end_state = gated_delta_rule_chunked(
        q[split:], k[split:], v[split:], decay[split:], beta[split:], mid_state, chunk_size=4
    )
    torch.testing.assert_close(torch.cat((first, rest)), whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(end_state, whole_state, atol=1e-5, rtol=1e-4)


def test_causal_conv1d_matches_transformers_and_continues():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(11, 6, generator=g)
    weight = torch.randn(6, 4, generator=g)
    want = hf.causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    got, state = causal_conv1d(x, weight)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(state, x[-3:].T)
    # prefill 7, then decode the rest one token at a time from the carried state
    first, state = causal_conv1d(x[:7], weight)
    parts = [first]
    for t in range(7, 11):
        y, state = causal_conv1d(x[t : t + 1], weight, state)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts), want)
    with pytest.raises(ValueError, match="'gelu'"):
        causal_conv1d(x, weight, activation="gelu")
