"""A quantized KV cache (FP8), the reference: how keys, values and MLA latents are stored
and read back. The conformance oracle for every backend that declares
`AttentionBackend.kv_cache_dtypes`.

A cache entry is `saturate(x / scale)` in the cache dtype and reads as `stored * scale`,
with one float32 scale per KV head (`scale` [num_kv_heads]; per layer: one value
repeated; MLA: [1] for the whole latent row). Saturating matters: casting a float past
the format's largest finite value to float8_e4m3fn gives NaN, not the largest value.
The scale comes from the checkpoint (`k_scale` / `v_scale`, as vLLM reads them), from a
calibration pass (`calibrated_scales`: amax / the format's largest value, per head;
vLLM's `calculate_kv_scales`) or is 1.0 (vLLM's default when uncalibrated).

The user-facing names are vLLM's: `--kv-cache-dtype auto | fp8 | fp8_e4m3 | fp8_e5m2`
(`fp8` is `fp8_e4m3`).
"""

from __future__ import annotations

import torch

# EngineArgs.kv_cache_dtype -> the dtype the cache stores ("auto": the compute dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
QUANTIZED_KV_DTYPES = frozenset(KV_CACHE_DTYPES.values())


def is_quantized(cache_dtype: torch.dtype) -> bool:
    """Whether a cache of `cache_dtype` holds scaled values (FP8) rather than plain ones."""
    return cache_dtype in QUANTIZED_KV_DTYPES


def _per_head(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`scale` [heads] shaped to multiply `x` [..., heads, dim] (or [T, dim] with one)."""
    return scale.float().to(x.device).view(-1, 1)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` [T, heads, dim] (or an MLA latent [T, 1, dim]) as stored in a `cache_dtype`
    cache: x / scale, saturated to the format's finite range, in float32 math."""
    limit = torch.finfo(cache_dtype).max
    return (x.float() / _per_head(scale, x)).clamp(-limit, limit).to(cache_dtype)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Cache entries [..., heads, dim] read back as float32: stored * scale."""
    return stored.float() * _per_head(scale, stored)


def unit_scales(num_kv_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [num_kv_heads] of 1.0: the scales of an uncalibrated cache (vLLM's default)."""
    return torch.ones(num_kv_heads, dtype=torch.float32, device=device)


# The smallest amax a calibrated scale is computed from: a head whose keys (or values)
# were all zero on the calibration sample gets scale AMAX_FLOOR / max, not 0 (x / 0 would
# store NaN); any positive scale stores zeros exactly.
AMAX_FLOOR = 1e-6


def head_amax(x: torch.Tensor) -> torch.Tensor:
    """float32 [heads]: the largest |x| of each head of `x` [T, heads, dim] (an MLA latent
    [T, 1, dim]: one value), over every token; what a calibration pass records."""
    return x.detach().abs().amax(dim=(0, 2)).float()


def calibrated_scales(amax: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """float32 scales for a `cache_dtype` cache from the observed `amax` [heads]: amax /
    the format's largest finite value (448 for e4m3), so the largest observed entry is
    stored at the top of the range and small ones keep their mantissa bits rather than
    falling into the subnormals; `AMAX_FLOOR` keeps an all-zero head's scale positive."""
    if not is_quantized(cache_dtype):
        raise ValueError(f"cache_dtype={cache_dtype} is not a quantized KV dtype "
                         f"({sorted(map(str, QUANTIZED_KV_DTYPES))}); it takes no scales")
    if not torch.isfinite(amax).all():
        raise ValueError(f"KV amax {amax.tolist()} is not finite: the calibration pass "
                         "overflowed; its scales would store NaN")
    return amax.float().clamp(min=AMAX_FLOOR) / torch.finfo(cache_dtype).max
