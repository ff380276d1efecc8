"""The kernels whose nvidia launch settings the compile records changed (paged attention's
float32 prefill rows and decode key tiles, the Gated DeltaNet, KDA and Mamba2 chunked
scans, the conv, the MoE grouped GEMMs) in the plugin's own settings (tokenmill_nvidia.configs HOPPER and BLACKWELL:
the tiles the ahead-of-time compile records certify spill-free) against the core's
references. Run by test_triton_kernels.py in a fresh process (TRITON_INTERPRET=1 without
a GPU); production key and state sizes (128), sequences across several chunks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gated_delta_cases import _delta_inputs
from kda_cases import _inputs as _kda_inputs

from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill.platforms.ops import reference
from tokenmill.platforms.ops.gated_delta import causal_conv1d, gated_delta_rule_chunked
from tokenmill.platforms.ops.kda import kda_chunked
from tokenmill.platforms.ops.mamba2 import discretize_dt, mamba2_chunked
from tokenmill_conformance.attention_harness import check_step, make_step, mixed_batch, to_device
from tokenmill_nvidia.configs import BLACKWELL, HOPPER
from tokenmill_triton import gated_delta as gd
from tokenmill_triton import kda, mamba2, moe
from tokenmill_triton.attention import TritonPagedAttention
from tokenmill_triton.configs import interpreter_mode

DEVICE = "cpu" if interpreter_mode() else "cuda"
CONFIGS = {name: dataclasses.replace(c, upcast_bf16_dot=interpreter_mode())
           for name, c in (("hopper", HOPPER), ("blackwell", BLACKWELL))}
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


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [128, 256])
def test_attention_in_the_plugin_settings(arch, dtype, head_size):
    """A mixed prefill and decode batch (poisoned free slots), then a decode-only step:
    float32 prefill in the plugin's float32 rows, decode in its decode key tiles."""
    spec = AttentionSpec(AttentionKind.SLIDING_WINDOW, 8, 2, head_size, dtype, 16, 40)
    backend = TritonPagedAttention(AttentionKind.SLIDING_WINDOW, CONFIGS[arch], "test")
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


@pytest.mark.parametrize("arch", CONFIGS)
def test_causal_conv1d_in_the_plugin_settings(arch):
    lens, channels = [1, 37, 3], 160  # several token tiles; a partial channel tile
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(lens), channels, generator=g)
    weight = torch.randn(channels, 4, generator=g)
    bias = torch.randn(channels, generator=g)
    states = torch.randn(len(lens), channels, 3, generator=g)
    got_states = states.clone().to(DEVICE)
    got = gd.causal_conv1d(*_dev(x, weight), got_states, lens, bias.to(DEVICE), "silu",
                           configs=CONFIGS[arch])
    for i, part in enumerate(_pieces(lens)):
        want, want_state = causal_conv1d(x[part], weight, states[i], bias, "silu")
        torch.testing.assert_close(got[part].cpu(), want, **TOL[torch.float32])
        torch.testing.assert_close(got_states[i].cpu(), want_state)


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moe_experts_in_the_plugin_settings(arch, dtype):
    tokens, experts, hidden, inter, top_k = 70, 4, 192, 128, 2  # two row tiles of 64
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    b13 = torch.randn(experts, 2 * inter, generator=g).to(dtype)
    b2 = torch.randn(experts, hidden, generator=g).to(dtype)
    args = (x, w13, w2, weights, ids, b13, b2, "swiglu_oai")
    got = moe.moe_experts(*_dev(*args[:7]), "swiglu_oai", configs=CONFIGS[arch])
    expected = reference.moe_experts(*args)
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)
