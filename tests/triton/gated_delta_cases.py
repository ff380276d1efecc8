"""The Gated DeltaNet Triton kernels (tokenmill_triton.gated_delta) against the core's
references (tokenmill.platforms.ops.gated_delta), one sequence at a time there, a ragged batch in one
launch here. Run by test_triton_kernels.py in a fresh process (TRITON_INTERPRET=1 without
a GPU); tiny shapes, with chunks of 16 so that sequences cross several chunk boundaries.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.platforms.ops.gated_delta import (
    causal_conv1d,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from tokenmill_triton import gated_delta as gd
from tokenmill_triton.configs import KernelConfigs, LinearAttentionConfig, interpreter_mode

DEVICE = "cpu" if interpreter_mode() else "cuda"
CONFIGS = KernelConfigs(
    linear=LinearAttentionConfig(chunk_size=16, block_v=16, conv_block_c=16, conv_block_t=8),
    upcast_bf16_dot=interpreter_mode(),
)
# float32 math in both; outputs rounded once to the dtype
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-4), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _delta_inputs(lens, hk=2, hv=4, dk=16, dv=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, hk, dk, generator=g).to(dtype)
    k = torch.randn(t, hk, dk, generator=g).to(dtype)
    v = torch.randn(t, hv, dv, generator=g).to(dtype)
    decay = -F.softplus(torch.randn(t, hv, generator=g)) * 0.5
    beta = torch.rand(t, hv, generator=g)
    states = torch.randn(len(lens), hv, dk, dv, generator=g) * 0.1
    states[0] = 0  # a fresh sequence
    return q, k, v, decay, beta, states


def _pieces(lens):
    start = 0
    for n in lens:
        yield slice(start, start + n)
        start += n


def _dev(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("lens", [[1, 5, 16, 37], [33], [16, 0, 2]], ids=str)
def test_chunked_scan_matches_the_reference(dtype, lens):
    q, k, v, decay, beta, states = _delta_inputs(lens, dtype=dtype)
    got_states = states.clone().to(DEVICE)
    got, _ = gd.gated_delta_chunked(*_dev(q, k, v, decay, beta), got_states, lens,
                                    configs=CONFIGS)
    assert got.dtype == dtype and got.shape == v.shape
    for i, part in enumerate(_pieces(lens)):
        want, want_state = gated_delta_rule_chunked(q[part], k[part], v[part], decay[part],
                                                    beta[part], states[i], chunk_size=8)
        torch.testing.assert_close(got[part].cpu(), want, **TOL[dtype])
        torch.testing.assert_close(got_states[i].cpu(), want_state, atol=2e-5, rtol=2e-4)


def test_chunked_scan_stores_the_checkpoints_asked_for():
    """States after any token count (not only chunk ends), as prefix-cache checkpoints want."""
    lens = [37, 9]
    wanted = [[3, 16, 20, 37], [9]]
    q, k, v, decay, beta, states = _delta_inputs(lens, hk=1, hv=2, seed=3)
    got_states = states.clone().to(DEVICE)
    _, ckpts = gd.gated_delta_chunked(*_dev(q, k, v, decay, beta), got_states, lens,
                                      checkpoints=wanted, configs=CONFIGS)
    assert ckpts.shape == (5, 2, 16, 24)
    at = 0
    for i, part in enumerate(_pieces(lens)):
        for n in wanted[i]:
            sub = slice(part.start, part.start + n)
            _, want = gated_delta_rule_recurrent(q[sub], k[sub], v[sub], decay[sub], beta[sub],
                                                 states[i])
            torch.testing.assert_close(ckpts[at].cpu(), want, atol=2e-5, rtol=2e-4)
            at += 1
    torch.testing.assert_close(ckpts[3], got_states[0])  # n == len: the final state
    with pytest.raises(ValueError, match=r"not in \[1, 9\]"):
        gd.gated_delta_chunked(*_dev(q, k, v, decay, beta), got_states, lens,
                               checkpoints=[[], [10]], configs=CONFIGS)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_recurrence_matches_the_reference(dtype):
    """Decode: one token for each of 5 sequences; and a sequence of 3 tokens among them."""
    for lens in ([1, 1, 1, 1, 1], [1, 3, 1]):
        q, k, v, decay, beta, states = _delta_inputs(lens, hk=1, hv=2, dk=32, dv=16,
                                                     dtype=dtype, seed=len(lens))
        got_states = states.clone().to(DEVICE)
        got = gd.gated_delta_recurrent(*_dev(q, k, v, decay, beta), got_states, lens,
                                       configs=CONFIGS)
        for i, part in enumerate(_pieces(lens)):
            want, want_state = gated_delta_rule_recurrent(q[part], k[part], v[part],
                                                          decay[part], beta[part], states[i])
            torch.testing.assert_close(got[part].cpu(), want, **TOL[dtype])
            torch.testing.assert_close(got_states[i].cpu(), want_state, atol=1e-5, rtol=1e-4)


def test_prefill_then_decode_carries_the_state():
    """Chunked prefill of 21 tokens, then 3 decodes, equals one recurrent pass of 24."""
    q, k, v, decay, beta, states = _delta_inputs([24], seed=5)
    want, want_state = gated_delta_rule_recurrent(q, k, v, decay, beta, states[0])
    s = states.clone().to(DEVICE)
    outs = [gd.gated_delta_chunked(*_dev(q[:21], k[:21], v[:21], decay[:21], beta[:21]), s,
                                   [21], configs=CONFIGS)[0]]
    for t in range(21, 24):
        sl = slice(t, t + 1)
        outs.append(gd.gated_delta_recurrent(*_dev(q[sl], k[sl], v[sl], decay[sl], beta[sl]),
                                             s, [1], configs=CONFIGS))
    torch.testing.assert_close(torch.cat(outs).cpu(), want, atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(s[0].cpu(), want_state, atol=2e-5, rtol=2e-4)


def test_bad_shapes_are_refused():
    q, k, v, decay, beta, states = _delta_inputs([4])
    with pytest.raises(ValueError, match="query_lens sum to 5"):
        gd.gated_delta_recurrent(q, k, v, decay, beta, states, [5], configs=CONFIGS)
    with pytest.raises(ValueError, match="must be contiguous float32"):
        gd.gated_delta_chunked(q, k, v, decay, beta, states.double(), [4], configs=CONFIGS)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("width,bias,activation", [(4, True, "silu"), (2, False, None),
                                                   (4, False, "silu")])
def test_causal_conv1d_matches_the_reference(dtype, width, bias, activation):
    lens = [1, 7, 0, 19, 2]  # decode, prefill, empty, several tiles, shorter than K - 1
    channels = 24
    g = torch.Generator().manual_seed(width)
    x = torch.randn(sum(lens), channels, generator=g).to(dtype)
    weight = torch.randn(channels, width, generator=g).to(dtype)
    b = torch.randn(channels, generator=g).to(dtype) if bias else None
    states = torch.randn(len(lens), channels, width - 1, generator=g).to(dtype)
    states[1] = 0  # fresh
    got_states = states.clone().to(DEVICE)
    got = gd.causal_conv1d(x.to(DEVICE), weight.to(DEVICE), got_states, lens,
                           None if b is None else b.to(DEVICE), activation, configs=CONFIGS)
    for i, part in enumerate(_pieces(lens)):
        if part.stop == part.start:
            assert torch.equal(got_states[i].cpu(), states[i])
            continue
        want, want_state = causal_conv1d(x[part], weight, states[i], b, activation)
        torch.testing.assert_close(got[part].cpu(), want, **TOL[dtype])
        assert torch.equal(got_states[i].cpu(), want_state)
    with pytest.raises(ValueError, match="'gelu'"):
        gd.causal_conv1d(x, weight, states, lens, activation="gelu", configs=CONFIGS)
