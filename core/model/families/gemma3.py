"""Gemma 3 text models (HF model_type "gemma3_text"): sliding-window and global layers
interleaved, with Gemma's norms and scalings.

What differs from the llama graph (families/llama.py; it reuses the shared attention
layer and the base weight loading):

- `layer_types` interleave sliding-window layers (`sliding_window` tokens; five of six
  by default) with global ones, and the two kinds rotate with different tables: sliding
  layers with `rope_parameters["sliding_attention"]` (theta 10k), global layers with
  `rope_parameters["full_attention"]` (theta 1M, possibly linearly scaled);
- RMSNorm scales by (1 + weight), computed wholly in float32 before the cast back
  (`GemmaRMSNorm`); every layer has four of them: before and after attention and before
  and after the MLP (the "post" norms apply to the branch before the residual add);
  q and k are normalised per head the same way;
- the embedding is multiplied by sqrt(hidden_size), rounded to the model dtype;
- attention scales by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- the MLP's activation is tanh-approximated GELU (`gelu_tanh_and_mul`);
- logits are soft-capped when `final_logit_softcapping` is set.

Not supported (a ValueError says so): `attn_logit_softcapping` (Gemma 2's; Gemma 3 sets
it to None) and `use_bidirectional_attention`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tokenmill.model.base import CausalLM, DecoderModel, attention_specs
from tokenmill.model.family import ModelFamily, shrink_config
from tokenmill.model.layers import (
    Attention,
    GatedMLP,
    GemmaRMSNorm,
    RotaryEmbedding,
    add_norm,
    rope_parameters,
)
from tokenmill.model.linear import LayerBuilder
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.ops import Ops


class GeluMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, hf_config: Any, spec: AttentionSpec, rotary: RotaryEmbedding,
        backend: AttentionBackend, build: LayerBuilder, prefix: str,
    ) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        ops, dtype = build.ops, build.dtype
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.self_attn = Attention(
            hidden_size=hidden,
            spec=spec,
            rotary=rotary,
            backend=backend,
            build=build,
            prefix=f"{prefix}.self_attn",
            qkv_bias=bias,
            o_bias=bias,
            qk_norm_eps=eps,
            norm_cls=GemmaRMSNorm,
        )
        self.mlp = GeluMLP(hidden, hf_config.intermediate_size, False, build, f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(hidden, eps, ops, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, ops, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, ops, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, ops, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP branch, the residual before it); the next norm adds them."""
        hidden, residual = add_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(
            self.self_attn(positions, hidden, kv_cache, metadata)
        )
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


def _rotary_for(hf_config: Any, layer_type: str, head_size: int, ops: Ops) -> RotaryEmbedding:
    """The rotary table of one layer type (Gemma 3 keeps a parameter dict per type)."""
    per_type = getattr(hf_config, "rope_parameters", None) or {}
    params = per_type.get(layer_type) if isinstance(per_type, dict) else None
    if params is None:
        params = rope_parameters(hf_config)
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return RotaryEmbedding(params, head_size, hf_config.max_position_embeddings, ops)


class Gemma3Model(DecoderModel):
    """Scaled embedding, decoder layers, final norm (HF's `model.` prefix)."""

    norm_cls = GemmaRMSNorm

    def setup(self, hf_config: Any, specs: list[AttentionSpec], build: LayerBuilder) -> None:
        head_size = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        # one table per layer type, each shared by the layers of that type
        self.rotary_global = _rotary_for(hf_config, "full_attention", head_size, build.ops)
        self.rotary_local = _rotary_for(hf_config, "sliding_attention", head_size, build.ops)
        self.embed_scale = float(hf_config.hidden_size) ** 0.5

    def make_layer(
        self, hf_config: Any, index: int, spec: AttentionSpec, backend: AttentionBackend,
        build: LayerBuilder, prefix: str,
    ) -> nn.Module:
        sliding = spec.kind == AttentionKind.SLIDING_WINDOW
        rotary = self.rotary_local if sliding else self.rotary_global
        return Gemma3DecoderLayer(hf_config, spec, rotary, backend, build, prefix)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled embedding."""
        embed = self.embed_tokens(input_ids)
        # the scale is rounded to the model dtype first, as in the checkpoints' training
        return embed * torch.tensor(self.embed_scale, dtype=embed.dtype, device=embed.device)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 (text) over a paged KV cache; see the module docstring for what differs."""

    body_cls = Gemma3Model

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "attn_logit_softcapping", None) is not None:
            raise ValueError(
                f"attn_logit_softcapping={hf_config.attn_logit_softcapping}: attention logit "
                "soft-capping is not supported"
            )
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True is not supported (causal LMs only)")
        act = getattr(hf_config, "hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
        super().__init__(hf_config, **kwargs)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def gemma3_specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    """Sliding and global layers, scaled by query_pre_attn_scalar ** -0.5."""
    scale = float(hf_config.query_pre_attn_scalar) ** -0.5
    return [
        dataclasses.replace(s, scale=scale) for s in attention_specs(hf_config, dtype, block_size)
    ]


def tiny(hf_config: Any) -> Any:
    """A sliding layer (window 8) then a global one."""
    return shrink_config(
        hf_config, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, max_position_embeddings=512,
    )


FAMILY = ModelFamily(
    name="gemma3",
    model_types=("gemma3_text",),
    model=Gemma3ForCausalLM,
    attention_specs=gemma3_specs,
    tiny=tiny,
)
