"""Rotary position tables: the reference every platform's `rotary_embedding` reads.

`rope_parameters` reads a config's rotary settings (both transformers layouts);
`build_cos_sin_cache` turns them into the float32 cos | sin table the core's layers and a
plugin's own model runner (tokenmill_tpu) index by position, with the same arithmetic as
transformers for each supported rope type.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's rotary parameters as one dict with at least `rope_theta` and `rope_type`.

    transformers >= 5 keeps them in `config.rope_parameters`; older configs have `rope_theta`
    beside an optional `rope_scaling` dict (whose type key was once `type`). Both are read.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, a smooth band between.

    Same arithmetic as transformers' `_compute_llama3_parameters`, so tables match bit for bit.
    """
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    params: Mapping[str, Any], rotary_dim: int, max_position: int, device: torch.device | None
) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, DeepSeek): frequencies blended between interpolated and extrapolated
    along a ramp over the dimensions, and the factor that scales cos and sin.

    Same arithmetic as transformers' `_compute_yarn_parameters`.
    """
    base, dim = params["rope_theta"], rotary_dim
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low))
    extrapolation = 1 - ramp.clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def build_cos_sin_cache(
    params: Mapping[str, Any], rotary_dim: int, max_position: int, device: torch.device | None
) -> torch.Tensor:
    """float32 [max_position, rotary_dim] table: cos of the angles | sin of the angles
    (both times YaRN's attention factor when the rope type is yarn).

    Float32 whatever the model dtype: bf16 angles lose whole radians past a few thousand
    positions.
    """
    rope_type = params["rope_type"]
    base = params["rope_theta"]
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (base ** (exponents / rotary_dim))
    scaling = 1.0
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    elif rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "yarn":
        inv_freq, scaling = _yarn_inv_freq(params, rotary_dim, max_position, device)
    elif rope_type != "default":
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return torch.cat((angles.cos() * scaling, angles.sin() * scaling), dim=-1)
