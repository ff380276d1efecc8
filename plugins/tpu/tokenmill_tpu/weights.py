"""HF-named checkpoint tensors -> the JAX model's parameters, converted once.

The tensors come through the core's loaders (safetensors or GGUF, already HF-named and,
for GGUF, dequantized); each is converted to numpy once, transposed to [in, out] for
`x @ W`, and stacked by layer so the model scans one layer body. Unknown names and
missing weights are errors naming them, as in the core's `load_weights`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from tokenmill.platforms.ops.rotary import build_cos_sin_cache, rope_parameters
from tokenmill_tpu.convert import numpy_dtype, to_numpy
from tokenmill_tpu.model import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF name inside a layer -> (our name, transpose)
_LAYER_NAMES = {
    "self_attn.q_proj.weight": ("q", True),
    "self_attn.k_proj.weight": ("k", True),
    "self_attn.v_proj.weight": ("v", True),
    "self_attn.o_proj.weight": ("o", True),
    "self_attn.q_proj.bias": ("q_bias", False),
    "self_attn.k_proj.bias": ("k_bias", False),
    "self_attn.v_proj.bias": ("v_bias", False),
    "self_attn.o_proj.bias": ("o_bias", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("gate", True),
    "mlp.up_proj.weight": ("up", True),
    "mlp.down_proj.weight": ("down", True),
    "mlp.gate_proj.bias": ("gate_bias", False),
    "mlp.up_proj.bias": ("up_bias", False),
    "mlp.down_proj.bias": ("down_bias", False),
    "input_layernorm.weight": ("input_norm", False),
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("pre_ff_norm", False),
    "post_feedforward_layernorm.weight": ("post_ff_norm", False),
}


def expected_layer_names(cfg: ModelConfig) -> set[str]:
    names = {"q", "k", "v", "o", "gate", "up", "down", "input_norm", "post_attn_norm"}
    if cfg.qkv_bias:
        names |= {"q_bias", "k_bias", "v_bias"}
    if cfg.o_bias:
        names.add("o_bias")
    if cfg.mlp_bias:
        names |= {"gate_bias", "up_bias", "down_bias"}
    if cfg.qk_norm:
        names |= {"q_norm", "k_norm"}
    if cfg.gemma:
        names |= {"pre_ff_norm", "post_ff_norm"}
    return names


def convert_weights(
    cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> dict[str, Any]:
    """numpy params {embed, final_norm, [lm_head], layers: {name: [num_layers, ...]}} in
    `dtype`. Raises KeyError naming an unknown or missing weight."""
    target = numpy_dtype(dtype)
    top: dict[str, np.ndarray] = {}
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, tensor in weights:
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = to_numpy(tensor.to(dtype))
        match = _LAYER.match(hf_name)
        if match and match.group(2) in _LAYER_NAMES:
            name, transpose = _LAYER_NAMES[match.group(2)]
            per_layer.setdefault(name, {})[int(match.group(1))] = array.T if transpose else array
        elif hf_name == "model.embed_tokens.weight":
            top["embed"] = array
        elif hf_name == "model.norm.weight":
            top["final_norm"] = array
        elif hf_name == "lm_head.weight":
            top["lm_head"] = array.T
        else:
            raise KeyError(f"checkpoint weight {hf_name!r} has no parameter in the tpu "
                           f"runner's {cfg.model_type} model")
    missing = sorted(
        f"model.layers.{i}.<{name}>"
        for name in expected_layer_names(cfg)
        for i in range(cfg.num_layers)
        if i not in per_layer.get(name, {})
    )
    top_needed = {"embed", "final_norm"} | (set() if cfg.tie_word_embeddings else {"lm_head"})
    missing += sorted(top_needed - set(top))
    if missing:
        raise KeyError(f"checkpoint is missing weights: {missing[:8]}"
                       + (f" ... ({len(missing)} in all)" if len(missing) > 8 else ""))
    layers = {
        name: np.stack([per_layer[name][i] for i in range(cfg.num_layers)]).astype(target)
        for name in sorted(per_layer)
    }
    return {**{k: v.astype(target) for k, v in top.items()}, "layers": layers}


def rope_tables(hf_config: Any, cfg: ModelConfig, max_position: int) -> np.ndarray:
    """float32 [2, max_position, rotary_dim]: the full-attention layers' cos|sin table and
    the sliding layers' (the same table unless the model gives them their own, as Gemma 3
    does), built by the core's own `build_cos_sin_cache`."""
    params = rope_parameters(hf_config)
    per_type = {
        kind: dict(params[kind])
        for kind in ("full_attention", "sliding_attention")
        if isinstance(params.get(kind), dict)
    }
    for kind in per_type.values():
        kind.setdefault("rope_type", "default")
        kind["rope_type"] = kind.get("rope_type") or kind.get("type") or "default"
    full = per_type.get("full_attention", params)
    sliding = per_type.get("sliding_attention", full)
    rotary_dim = int(cfg.head_size * full.get("partial_rotary_factor", 1.0))
    tables = [
        build_cos_sin_cache(p, rotary_dim, max_position, device=None).numpy() for p in (full, sliding)
    ]
    return np.stack(tables).astype(np.float32)
