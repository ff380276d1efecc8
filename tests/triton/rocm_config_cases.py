"""The kernels whose rocm launch settings the compile records changed (the Gated DeltaNet,
KDA and Mamba2 chunked scans and the delta-rule recurrences: tokenmill_rocm.configs LINEAR,
16-token chunks, 16 value columns, 4 key channels per KDA pair tile; gfx950's prefill
attention, 4 warps now, whose 128 x 128 K/V tiles the interpreter certification never runs)
in the plugin's own settings (CDNA3 = gfx942, CDNA4 = gfx950; each distinct linear setting
once) against the core's references. The rocm interpreter certification keeps the default
linear tiles and gfx942's attention, so this is where these tiles run in the interpreter. Run by
test_triton_kernels.py in a fresh process (TRITON_INTERPRET=1 without a GPU); production
key and state sizes (128), sequences across several chunks."""

from __future__ import annotations

import dataclasses

import pytest
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
from tokenmill_rocm.configs import CDNA3, CDNA4
from tokenmill_triton import gated_delta as gd
from tokenmill_triton import kda, mamba2
from tokenmill_triton.attention import TritonPagedAttention
from tokenmill_triton.configs import interpreter_mode

DEVICE = "cpu" if interpreter_mode() else "cuda"
_DISTINCT: dict = {}
for _arch, _configs in (("gfx942", CDNA3), ("gfx950", CDNA4)):
    _DISTINCT.setdefault(_configs.linear, (_arch, _configs))
CONFIGS = {arch: dataclasses.replace(c, upcast_bf16_dot=interpreter_mode())
           for arch, c in _DISTINCT.values()}
TOL = {torch.float32: dict(atol=3e-5, rtol=3e-4), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
STATE_TOL = dict(atol=3e-5, rtol=3e-4)
LENS = [1, 37, 16]  # one token, chunks and a partial one, exactly one 16-token chunk


def _pieces(lens):
    start = 0
    for n in lens:
        yield slice(start, start + n)
        start += n


def _dev(*ts):
    return [t if t is None else t.to(DEVICE) for t in ts]


def test_the_settings_differ_from_the_interpreter_certification():
    """The point of this file: the certification runs other linear tiles."""
    from tokenmill_rocm.configs import INTERPRETER

    assert all(c.linear != INTERPRETER.linear for c in CONFIGS.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gfx950_attention_in_the_plugin_settings(dtype):
    """Head 256 in gfx950's 64-key K/V tiles (gfx942's are 32): a mixed prefill and decode
    batch (poisoned free slots), then a decode-only step."""
    configs = dataclasses.replace(CDNA4, upcast_bf16_dot=interpreter_mode())
    spec = AttentionSpec(AttentionKind.SLIDING_WINDOW, 8, 2, 256, dtype, 16, 40)
    backend = TritonPagedAttention(AttentionKind.SLIDING_WINDOW, configs, "test")
    device = torch.device(DEVICE)
    check_step(backend, spec, to_device(make_step(mixed_batch(1), spec, 1, poison=True), device))
    check_step(backend, spec, to_device(make_step([(70, 1), (5, 1)], spec, 2), device))


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_delta", "kda"])
def test_delta_rule_chunked_in_the_plugin_settings(arch, dtype, per_channel):
    make = _kda_inputs if per_channel else _delta_inputs
    q, k, v, decay, beta, states = make(LENS, hk=1, hv=2, dk=128, dv=64, dtype=dtype, seed=7)
    got_states = states.clone().to(DEVICE)
    scan = kda.kda_chunked if per_channel else gd.gated_delta_chunked
    got, _ = scan(*_dev(q, k, v, decay, beta), got_states, LENS, configs=CONFIGS[arch])
    reference = kda_chunked if per_channel else gated_delta_rule_chunked
    for i, part in enumerate(_pieces(LENS)):
        want, want_state = reference(q[part], k[part], v[part], decay[part], beta[part],
                                     states[i], chunk_size=8)
        torch.testing.assert_close(got[part].cpu(), want, **TOL[dtype])
        torch.testing.assert_close(got_states[i].cpu(), want_state, **STATE_TOL)


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_delta", "kda"])
def test_delta_rule_recurrence_in_the_plugin_settings(arch, per_channel):
    """Decode in the settings' value columns (several programs across dv = 64)."""
    lens = [1, 3, 1]
    make = _kda_inputs if per_channel else _delta_inputs
    q, k, v, decay, beta, states = make(lens, hk=1, hv=2, dk=128, dv=64, seed=3)
    got_states = states.clone().to(DEVICE)
    scan = kda.kda_recurrent if per_channel else gd.gated_delta_recurrent
    got = scan(*_dev(q, k, v, decay, beta), got_states, lens, configs=CONFIGS[arch])
    reference = kda_recurrent if per_channel else gated_delta_rule_recurrent
    for i, part in enumerate(_pieces(lens)):
        want, want_state = reference(q[part], k[part], v[part], decay[part], beta[part],
                                     states[i])
        torch.testing.assert_close(got[part].cpu(), want, **TOL[torch.float32])
        torch.testing.assert_close(got_states[i].cpu(), want_state, **STATE_TOL)


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mamba2_chunked_in_the_plugin_settings(arch, dtype):
    heads, p, groups, n = 2, 64, 1, 128  # production head dim and state size
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
    got, _ = mamba2.mamba2_chunked(*_dev(x, dt, A, B, C, D, dt_bias), got_states, LENS,
                                   configs=CONFIGS[arch])
    limit = (0.0, float("inf"))
    for i, part in enumerate(_pieces(LENS)):
        step = discretize_dt(dt[part], dt_bias, limit)
        want, want_state, _ = mamba2_chunked(x[part], step, A, B[part], C[part], D, states[i],
                                             chunk_size=8)
        torch.testing.assert_close(got[part].cpu(), want, **TOL[dtype])
        torch.testing.assert_close(got_states[i].cpu(), want_state, **STATE_TOL)
