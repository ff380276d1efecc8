"""The Mamba2 Triton kernels (tokenmill_triton.mamba2) against the core's references
(tokenmill.platforms.ops.mamba2: `discretize_dt`, `mamba2_chunked`, `mamba2_state_update`), one
sequence at a time there, a ragged batch in one launch here. Run by test_triton_kernels.py
in a fresh process (TRITON_INTERPRET=1 without a GPU); tiny shapes (a head dim of 8,
padded to the 16-row tl.dot minimum), chunks of 16 so that sequences cross several chunk
boundaries, and x, B, C as strided views of one conv output as the backend passes them.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.platforms.ops.mamba2 import discretize_dt, mamba2_chunked, mamba2_state_update
from tokenmill_triton import mamba2
from tokenmill_triton.configs import KernelConfigs, LinearAttentionConfig, interpreter_mode

DEVICE = "cpu" if interpreter_mode() else "cuda"
CONFIGS = KernelConfigs(
    linear=LinearAttentionConfig(chunk_size=16, ssd_block_p=16),
    upcast_bf16_dot=interpreter_mode(),
)
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-4), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
STATE_TOL = dict(atol=3e-5, rtol=3e-4)
DTYPES = [torch.float32, torch.bfloat16]
H, P, G, N = 4, 8, 2, 16


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _inputs(lens, dtype=torch.float32, seed=0, head_dim=P):
    """(x, dt_raw, A, B, C, D, dt_bias, states); x, B and C are views of one [T, C] tensor."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    conved = torch.randn(t, H * head_dim + 2 * G * N, generator=g).to(dtype)
    x, B, C = conved.split([H * head_dim, G * N, G * N], dim=-1)
    x = x.unflatten(-1, (H, head_dim))
    B, C = B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N))
    dt = torch.randn(t, H, generator=g).to(dtype)
    A = -torch.rand(H, generator=g) - 0.2
    D = torch.randn(H, generator=g).to(dtype)
    dt_bias = torch.randn(H, generator=g).to(dtype)
    states = torch.randn(len(lens), H, head_dim, N, generator=g) * 0.3
    states[0] = 0  # a fresh sequence
    return x, dt, A, B, C, D, dt_bias, states


def _pieces(lens):
    start = 0
    for n in lens:
        yield slice(start, start + n)
        start += n


def _dev(*ts):
    return [t if t is None else t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("lens,with_d,limit", [([1, 5, 16, 37], True, (0.0, float("inf"))),
                                               ([33], False, (0.05, 0.6)),
                                               ([16, 0, 2], True, (0.0, float("inf")))],
                         ids=str)
def test_chunked_scan_matches_the_reference(dtype, lens, with_d, limit):
    """Ragged lengths (one token, a partial chunk, exactly a chunk, several, empty), with
    and without the skip D, with and without a dt limit (clamped steps)."""
    x, dt, A, B, C, D, dt_bias, states = _inputs(lens, dtype)
    D = D if with_d else None
    got_states = states.clone().to(DEVICE)
    got, _ = mamba2.mamba2_chunked(*_dev(x, dt, A, B, C, D, dt_bias), got_states, lens,
                                   dt_limit=limit, configs=CONFIGS)
    assert got.dtype == dtype and got.shape == x.shape
    for i, part in enumerate(_pieces(lens)):
        if part.start == part.stop:  # no tokens: the state is left as it was
            assert torch.equal(got_states[i].cpu(), states[i])
            continue
        step = discretize_dt(dt[part], dt_bias, limit)
        want, want_state, _ = mamba2_chunked(x[part], step, A, B[part], C[part], D, states[i],
                                             chunk_size=8)
        torch.testing.assert_close(got[part].cpu(), want, **TOL[dtype])
        torch.testing.assert_close(got_states[i].cpu(), want_state, **STATE_TOL)


def test_chunked_scan_stores_the_checkpoints_asked_for():
    """States after any token count (not only chunk ends): the reference's boundaries."""
    lens = [37, 9]
    wanted = [[3, 16, 20, 37], [9]]
    x, dt, A, B, C, D, dt_bias, states = _inputs(lens, seed=3)
    got_states = states.clone().to(DEVICE)
    _, ckpts = mamba2.mamba2_chunked(*_dev(x, dt, A, B, C, D, dt_bias), got_states, lens,
                                     checkpoints=wanted, configs=CONFIGS)
    assert ckpts.shape == (5, H, P, N)
    at = 0
    for i, part in enumerate(_pieces(lens)):
        step = discretize_dt(dt[part], dt_bias)
        _, _, want = mamba2_chunked(x[part], step, A, B[part], C[part], D, states[i],
                                    chunk_size=8, boundaries=wanted[i])
        for j in range(len(wanted[i])):
            torch.testing.assert_close(ckpts[at].cpu(), want[j], **STATE_TOL)
            at += 1
    torch.testing.assert_close(ckpts[3], got_states[0])  # n == len: the final state
    with pytest.raises(ValueError, match=r"not in \[1, 9\]"):
        mamba2.mamba2_chunked(*_dev(x, dt, A, B, C, D, dt_bias), got_states, lens,
                              checkpoints=[[], [10]], configs=CONFIGS)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_state_update_matches_the_reference(dtype):
    """Decode: one token for each of 5 sequences (a head dim of 24: two P blocks of 16)."""
    lens = [1] * 5
    x, dt, A, B, C, D, dt_bias, states = _inputs(lens, dtype, seed=4, head_dim=24)
    got_states = states.clone().to(DEVICE)
    got = mamba2.mamba2_state_update(*_dev(x, dt, A, B, C, D, dt_bias), got_states, lens,
                                     configs=CONFIGS)
    want, want_states = mamba2_state_update(states, x, discretize_dt(dt, dt_bias), A, B, C, D)
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    torch.testing.assert_close(got_states.cpu(), want_states, atol=1e-5, rtol=1e-4)


def test_prefill_then_decode_carries_the_state():
    """Chunked prefill of 21 tokens, then 3 decodes, equals one chunked pass of 24."""
    x, dt, A, B, C, D, dt_bias, states = _inputs([24], seed=5)
    want, want_state, _ = mamba2_chunked(x, discretize_dt(dt, dt_bias), A, B, C, D, states[0])
    s = states[:1].clone().to(DEVICE)
    pre = slice(0, 21)
    outs = [mamba2.mamba2_chunked(*_dev(x[pre], dt[pre], A, B[pre], C[pre], D, dt_bias), s,
                                  [21], configs=CONFIGS)[0]]
    for t in range(21, 24):
        sl = slice(t, t + 1)
        outs.append(mamba2.mamba2_state_update(*_dev(x[sl], dt[sl], A, B[sl], C[sl], D,
                                                     dt_bias), s, [1], configs=CONFIGS))
    torch.testing.assert_close(torch.cat(outs).cpu(), want, **STATE_TOL)
    torch.testing.assert_close(s[0].cpu(), want_state, **STATE_TOL)


def test_bad_shapes_are_refused():
    x, dt, A, B, C, D, dt_bias, states = _inputs([4])
    with pytest.raises(ValueError, match="query_lens sum to 5"):
        mamba2.mamba2_state_update(x, dt, A, B, C, D, dt_bias, states[:1], [5], configs=CONFIGS)
    with pytest.raises(ValueError, match=r"dt \(4, 3\) must be \[4, 4\]"):
        mamba2.mamba2_chunked(x, dt[:, :3], A, B, C, D, dt_bias, states[:1], [4],
                              configs=CONFIGS)
    with pytest.raises(ValueError, match="must be contiguous float32"):
        mamba2.mamba2_chunked(x, dt, A, B, C, D, dt_bias, states[:1].double(), [4],
                              configs=CONFIGS)
