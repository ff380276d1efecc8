"""Bamba (HF model_type "bamba"): a Mamba2 hybrid; most layers are Mamba2 mixers, the
layers in `attn_layer_indices` full attention, and every layer has a SwiGLU MLP.

What differs from the llama graph (core/model/llama.py, whose attention, MLP, model body
and weight loading it reuses):

- a layer is a `Mamba2Mixer` (core/model/mamba2.py, an AttentionKind.LINEAR layer with
  a recurrent state per sequence) unless its index is in `attn_layer_indices`;
- attention rotates only the first half of each head (`partial_rotary_factor` 0.5,
  which transformers hard-codes for Bamba) and has no q/k norm;
- names: the MLP is `feed_forward`, the norm before it `pre_ff_layernorm`, the final
  norm `model.final_layernorm`; `_convert` maps them onto the llama names.

Tensor parallel: the mixer by heads with their B/C groups (`Mamba2Mixer.shard_for_tp`;
`mamba_n_groups` must split over the ranks), attention and MLP as llama's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.model.layers import (
    Attention,
    Embedding,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    rope_parameters,
)
from tokenmill.model.llama import CausalLM, Model
from tokenmill.model.mamba2 import Mamba2Mixer, mamba2_dims
from tokenmill.ops import Ops
from tokenmill.ops.mamba2 import mamba2_state_spec
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)

# HF name piece -> ours (the llama body's)
_RENAMES = (
    (".feed_forward.", ".mlp."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    ("model.final_layernorm.", "model.norm."),
)


def bamba_attention_specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    """LINEAR for the Mamba2 layers, FULL for those in `attn_layer_indices`."""
    num_heads = hf_config.num_attention_heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    dims = mamba2_dims(hf_config)
    specs = []
    for layer_type in hf_config.layers_block_type:
        if layer_type == "full_attention":
            specs.append(AttentionSpec(
                kind=AttentionKind.FULL, num_heads=num_heads,
                num_kv_heads=hf_config.num_key_value_heads or num_heads, head_size=head_size,
                dtype=dtype, block_size=block_size,
            ))
        else:
            # informative sizes: value heads, B/C groups (the "key" heads), state size
            specs.append(AttentionSpec(
                kind=AttentionKind.LINEAR, num_heads=dims.num_heads,
                num_kv_heads=dims.num_groups, head_size=dims.state_size, dtype=dtype,
                block_size=block_size, state=mamba2_state_spec(dims, dtype),
            ))
    return specs


class BambaDecoderLayer(nn.Module):
    """Pre-norm block: a Mamba2 mixer or attention, then the MLP."""

    def __init__(
        self,
        hf_config: Any,
        spec: AttentionSpec,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        ops: Ops,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.is_mamba = spec.kind == AttentionKind.LINEAR
        if self.is_mamba:
            self.mamba = Mamba2Mixer(
                hidden, mamba2_dims(hf_config), backend=backend, spec=spec, eps=eps,
                conv_bias=bool(hf_config.mamba_conv_bias),
                proj_bias=bool(hf_config.mamba_proj_bias), dtype=dtype,
            )
        else:
            bias = bool(getattr(hf_config, "attention_bias", False))
            self.self_attn = Attention(
                hidden_size=hidden, spec=spec, rotary=rotary, backend=backend, ops=ops,
                dtype=dtype, qkv_bias=bias, o_bias=bias, qk_norm_eps=None,
            )
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        self.mlp = GatedMLP(hidden, hf_config.intermediate_size, mlp_bias, ops, dtype)
        self.input_layernorm = RMSNorm(hidden, eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: Any,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_mamba:
            hidden = self.mamba(hidden, kv_cache, metadata)
        else:
            hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class BambaModel(Model):
    """The llama body (embedding, layers, final norm) over Bamba's layers; the rotary
    table is sized by the attention layers' heads (the llama body reads layer 0's spec,
    here a mixer's)."""

    def __init__(
        self,
        hf_config: Any,
        specs: list[AttentionSpec],
        backends: list[AttentionBackend],
        ops: Ops,
        dtype: torch.dtype,
    ) -> None:
        nn.Module.__init__(self)
        attention = [s for s in specs if s.kind != AttentionKind.LINEAR]
        head_size = attention[0].head_size if attention else specs[0].head_size
        params = rope_parameters(hf_config)
        rotary_dim = int(head_size * params.get("partial_rotary_factor", 1.0))
        self.rotary_emb = RotaryEmbedding(params, rotary_dim, hf_config.max_position_embeddings, ops)
        self.embed_tokens = Embedding(hf_config.vocab_size, hf_config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            BambaDecoderLayer(hf_config, spec, self.rotary_emb, backend, ops, dtype)
            for spec, backend in zip(specs, backends, strict=True)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, ops, dtype)


class BambaForCausalLM(CausalLM):
    """Bamba over the recurrent-state and paged KV arena; see the module docstring."""

    @classmethod
    def attention_specs_for(
        cls, hf_config: Any, dtype: torch.dtype, block_size: int
    ) -> list[AttentionSpec]:
        return bamba_attention_specs(hf_config, dtype, block_size)

    def _build_model(
        self,
        hf_config: Any,
        specs: list[AttentionSpec],
        backends: list[AttentionBackend],
        ops: Ops,
        dtype: torch.dtype,
    ) -> nn.Module:
        return BambaModel(hf_config, specs, backends, ops, dtype)

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        for old, new in _RENAMES:
            hf_name = hf_name.replace(old, new)
        if hf_name.endswith(".mamba.conv1d.weight"):
            tensor = tensor.squeeze(1)  # [C, 1, K] -> [C, K]
        yield from super()._convert(hf_name, tensor)
