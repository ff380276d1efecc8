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
from plugin_config_checks import (
    check_attention,
    check_delta_rule_chunked,
    check_delta_rule_recurrence,
    check_mamba2_chunked,
)

from tokenmill_rocm.configs import CDNA3, CDNA4
from tokenmill_triton.configs import interpreter_mode

_DISTINCT: dict = {}
for _arch, _configs in (("gfx942", CDNA3), ("gfx950", CDNA4)):
    _DISTINCT.setdefault(_configs.linear, (_arch, _configs))
CONFIGS = {arch: dataclasses.replace(c, upcast_bf16_dot=interpreter_mode())
           for arch, c in _DISTINCT.values()}


def test_the_settings_differ_from_the_interpreter_certification():
    """The point of this file: the certification runs other linear tiles."""
    from tokenmill_rocm.configs import INTERPRETER

    assert all(c.linear != INTERPRETER.linear for c in CONFIGS.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gfx950_attention_in_the_plugin_settings(dtype):
    """Head 256 in gfx950's 64-key K/V tiles (gfx942's are 32)."""
    check_attention(dataclasses.replace(CDNA4, upcast_bf16_dot=interpreter_mode()), dtype, 256)


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_delta", "kda"])
def test_delta_rule_chunked_in_the_plugin_settings(arch, dtype, per_channel):
    check_delta_rule_chunked(CONFIGS[arch], dtype, per_channel)


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_delta", "kda"])
def test_delta_rule_recurrence_in_the_plugin_settings(arch, per_channel):
    check_delta_rule_recurrence(CONFIGS[arch], per_channel)


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mamba2_chunked_in_the_plugin_settings(arch, dtype):
    check_mamba2_chunked(CONFIGS[arch], dtype)
