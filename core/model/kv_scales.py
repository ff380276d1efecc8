"""The scales of a quantized (FP8) KV cache, per attention layer.

Each attention layer whose spec sets `cache_dtype` keeps two float32 buffers, `k_scale`
and `v_scale`, one value per KV head on this rank ([num_kv_heads]; MLA: [1], the latent
row's), and hands them to its backend (`AttentionBackend.forward`'s keywords). They are
1.0 unless the checkpoint carries them: vLLM's names `<layer>.self_attn.k_scale` /
`v_scale` (or one `kv_scale` for both), a scalar per layer or one value per KV head. A
checkpoint's scales for a model whose cache is not quantized are skipped (as vLLM does).
Uncalibrated scales of 1.0 are vLLM's default too: FP8 e4m3 holds +-448, ample for the
keys and values of the models here (tests and docs/quantized-kv.md measure the error).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill.platforms.ops.kv_quant import unit_scales

logger = logging.getLogger(__name__)

SCALE_NAMES = ("k_scale", "v_scale", "kv_scale")


def add_kv_scales(module: nn.Module, spec: AttentionSpec) -> None:
    """Give `module` (an attention layer) its scale buffers when `spec`'s cache is quantized."""
    if spec.cache_dtype is None:
        return
    module.register_buffer("k_scale", unit_scales(spec.num_kv_heads), persistent=False)
    module.register_buffer("v_scale", unit_scales(spec.num_kv_heads), persistent=False)


def kv_scale_kwargs(module: nn.Module) -> dict[str, torch.Tensor]:
    """The `k_scale` / `v_scale` keywords of `module`'s backend call ({} when unquantized)."""
    k_scale = getattr(module, "k_scale", None)
    return {} if k_scale is None else {"k_scale": k_scale, "v_scale": module.v_scale}


def is_kv_scale(hf_name: str) -> bool:
    """Whether a checkpoint tensor is a KV cache scale (`...self_attn.k_scale`)."""
    return hf_name.rpartition(".")[2] in SCALE_NAMES


def load_kv_scale(modules: dict[str, nn.Module], hf_name: str, tensor: torch.Tensor) -> None:
    """Copy a checkpoint's KV scale into its layer's buffer(s). KeyError naming the tensor
    when no layer of that name exists; ValueError naming its shape when it is neither a
    scalar nor one value per KV head of the layer."""
    module_name, _, which = hf_name.rpartition(".")
    module = modules.get(module_name)
    if module is None:
        raise KeyError(f"checkpoint KV scale {hf_name!r} names no attention layer "
                       f"{module_name!r} of this model")
    if getattr(module, "k_scale", None) is None:
        logger.debug("%s skipped: the layer's KV cache is not quantized", hf_name)
        return
    targets = [module.k_scale, module.v_scale] if which == "kv_scale" else [getattr(module, which)]
    values = tensor.detach().float().flatten()
    if values.numel() not in (1, targets[0].numel()):
        raise ValueError(
            f"checkpoint KV scale {hf_name!r} has {values.numel()} values; expected one, or "
            f"one per KV head ({targets[0].numel()}) of this rank's layer"
        )
    if not torch.isfinite(values).all() or (values <= 0).any():
        raise ValueError(f"checkpoint KV scale {hf_name!r} holds {values.tolist()}; scales "
                         "must be finite and positive")
    for target in targets:
        target.copy_(values.expand(target.numel()))


def with_kv_cache_dtype(
    specs: list[AttentionSpec], cache_dtype: torch.dtype | None
) -> list[AttentionSpec]:
    """`specs` with every attention layer's cache in `cache_dtype` (None: unchanged); LINEAR
    layers keep their states' dtypes."""
    if cache_dtype is None:
        return specs
    return [
        s if s.kind == AttentionKind.LINEAR else dataclasses.replace(s, cache_dtype=cache_dtype)
        for s in specs
    ]
