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
from plugin_config_checks import (
    DEVICE,
    TOL,
    check_attention,
    check_delta_rule_chunked,
    check_mamba2_chunked,
    dev,
    pieces,
)

from tokenmill.platforms.ops import reference
from tokenmill.platforms.ops.gated_delta import causal_conv1d
from tokenmill_nvidia.configs import BLACKWELL, HOPPER
from tokenmill_triton import gated_delta as gd
from tokenmill_triton import moe
from tokenmill_triton.configs import interpreter_mode

CONFIGS = {name: dataclasses.replace(c, upcast_bf16_dot=interpreter_mode())
           for name, c in (("hopper", HOPPER), ("blackwell", BLACKWELL))}


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [128, 256])
def test_attention_in_the_plugin_settings(arch, dtype, head_size):
    """float32 prefill in the plugin's float32 rows, decode in its decode key tiles."""
    check_attention(CONFIGS[arch], dtype, head_size)


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_delta", "kda"])
def test_delta_rule_chunked_in_the_plugin_settings(arch, dtype, per_channel):
    check_delta_rule_chunked(CONFIGS[arch], dtype, per_channel)


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mamba2_chunked_in_the_plugin_settings(arch, dtype):
    check_mamba2_chunked(CONFIGS[arch], dtype)


@pytest.mark.parametrize("arch", CONFIGS)
def test_causal_conv1d_in_the_plugin_settings(arch):
    lens, channels = [1, 37, 3], 160  # several token tiles; a partial channel tile
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(lens), channels, generator=g)
    weight = torch.randn(channels, 4, generator=g)
    bias = torch.randn(channels, generator=g)
    states = torch.randn(len(lens), channels, 3, generator=g)
    got_states = states.clone().to(DEVICE)
    got = gd.causal_conv1d(*dev(x, weight), got_states, lens, bias.to(DEVICE), "silu",
                           configs=CONFIGS[arch])
    for i, part in enumerate(pieces(lens)):
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
    got = moe.moe_experts(*dev(*args[:7]), "swiglu_oai", configs=CONFIGS[arch])
    expected = reference.moe_experts(*args)
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)
