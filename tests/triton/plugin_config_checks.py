"""Checks of the shared Triton kernels in one plugin's launch settings against the core's
references, called by nvidia_config_cases.py and rocm_config_cases.py with their own
settings: production key and state sizes (128), sequences across several chunks."""

from __future__ import annotations

import torch
from gated_delta_cases import _delta_inputs
from kda_cases import _inputs as _kda_inputs

from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill.platforms.ops.gated_delta import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from tokenmill.platforms.ops.kda import kda_chunked, kda_recurrent
from tokenmill.platforms.ops.mamba2 import discretize_dt, mamba2_chunked
from tokenmill_conformance.attention_harness import check_step, make_step, mixed_batch, to_device
from tokenmill_triton import gated_delta as gd
from tokenmill_triton import kda, mamba2
from tokenmill_triton.attention import TritonPagedAttention
from tokenmill_triton.configs import KernelConfigs, interpreter_mode

DEVICE = "cpu" if interpreter_mode() else "cuda"
TOL = {torch.float32: dict(atol=3e-5, rtol=3e-4), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
STATE_TOL = dict(atol=3e-5, rtol=3e-4)
LENS = [1, 37, 16]  # one token, chunks and a partial one, exactly one 16-token chunk


def pieces(lens):
    start = 0
    for n in lens:
        yield slice(start, start + n)
        start += n


def dev(*ts):
    return [t if t is None else t.to(DEVICE) for t in ts]


def check_attention(configs: KernelConfigs, dtype: torch.dtype, head_size: int) -> None:
    """A mixed prefill and decode batch (poisoned free slots), then a decode-only step."""
    spec = AttentionSpec(AttentionKind.SLIDING_WINDOW, 8, 2, head_size, dtype, 16, 40)
    backend = TritonPagedAttention(AttentionKind.SLIDING_WINDOW, configs, "test")
    device = torch.device(DEVICE)
    check_step(backend, spec, to_device(make_step(mixed_batch(1), spec, 1, poison=True), device))
    check_step(backend, spec, to_device(make_step([(70, 1), (5, 1)], spec, 2), device))


def check_delta_rule_chunked(configs: KernelConfigs, dtype: torch.dtype,
                             per_channel: bool) -> None:
    """The Gated DeltaNet (per_channel False) or KDA chunked scan over LENS."""
    make = _kda_inputs if per_channel else _delta_inputs
    q, k, v, decay, beta, states = make(LENS, hk=1, hv=2, dk=128, dv=64, dtype=dtype, seed=7)
    got_states = states.clone().to(DEVICE)
    scan = kda.kda_chunked if per_channel else gd.gated_delta_chunked
    got, _ = scan(*dev(q, k, v, decay, beta), got_states, LENS, configs=configs)
    reference = kda_chunked if per_channel else gated_delta_rule_chunked
    for i, part in enumerate(pieces(LENS)):
        want, want_state = reference(q[part], k[part], v[part], decay[part], beta[part],
                                     states[i], chunk_size=8)
        torch.testing.assert_close(got[part].cpu(), want, **TOL[dtype])
        torch.testing.assert_close(got_states[i].cpu(), want_state, **STATE_TOL)


def check_delta_rule_recurrence(configs: KernelConfigs, per_channel: bool) -> None:
    """Decode in the settings' value columns (several programs across dv = 64)."""
    lens = [1, 3, 1]
    make = _kda_inputs if per_channel else _delta_inputs
    q, k, v, decay, beta, states = make(lens, hk=1, hv=2, dk=128, dv=64, seed=3)
    got_states = states.clone().to(DEVICE)
    scan = kda.kda_recurrent if per_channel else gd.gated_delta_recurrent
    got = scan(*dev(q, k, v, decay, beta), got_states, lens, configs=configs)
    reference = kda_recurrent if per_channel else gated_delta_rule_recurrent
    for i, part in enumerate(pieces(lens)):
        want, want_state = reference(q[part], k[part], v[part], decay[part], beta[part],
                                     states[i])
        torch.testing.assert_close(got[part].cpu(), want, **TOL[torch.float32])
        torch.testing.assert_close(got_states[i].cpu(), want_state, **STATE_TOL)


def check_mamba2_chunked(configs: KernelConfigs, dtype: torch.dtype) -> None:
    """Mamba2's chunked scan at the production head dim (64) and state size (128)."""
    heads, p, groups, n = 2, 64, 1, 128
    g = torch.Generator().manual_seed(11)
    t = sum(LENS)
    x = torch.randn(t, heads, p, generator=g).to(dtype)
    B = torch.randn(t, groups, n, generator=g).to(dtype)
    C = torch.randn(t, groups, n, generator=g).to(dtype)
    dt = torch.randn(t, heads, generator=g).to(dtype)
    A = -torch.rand(heads, generator=g) - 0.2
    D = torch.randn(heads, generator=g).to(dtype)
    dt_bias = torch.randn(heads, generator=g).to(dtype)
    states = torch.randn(len(LENS), heads, p, n, generator=g) * 0.3
    got_states = states.clone().to(DEVICE)
    got, _ = mamba2.mamba2_chunked(*dev(x, dt, A, B, C, D, dt_bias), got_states, LENS,
                                   configs=configs)
    limit = (0.0, float("inf"))
    for i, part in enumerate(pieces(LENS)):
        step = discretize_dt(dt[part], dt_bias, limit)
        want, want_state, _ = mamba2_chunked(x[part], step, A, B[part], C[part], D, states[i],
                                             chunk_size=8)
        torch.testing.assert_close(got[part].cpu(), want, **TOL[dtype])
        torch.testing.assert_close(got_states[i].cpu(), want_state, **STATE_TOL)
