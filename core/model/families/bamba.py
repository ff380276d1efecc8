"""Bamba (HF model_type "bamba"): a Mamba2 hybrid; most layers are Mamba2 mixers, the
layers in `attn_layer_indices` full attention, and every layer has a SwiGLU MLP.

What differs from the llama graph (families/llama.py; it reuses the shared attention,
MLP, body and weight loading):

- a layer is a `Mamba2Mixer` (core/model/mamba2.py, an AttentionKind.LINEAR layer with
  a recurrent state per sequence) unless its index is in `attn_layer_indices`;
- attention rotates only the first half of each head (`partial_rotary_factor` 0.5,
  which transformers hard-codes for Bamba) and has no q/k norm;
- names: the MLP is `feed_forward`, the norm before it `pre_ff_layernorm`, the final
  norm `model.final_layernorm`; `_convert` maps them onto the llama names.

Tensor parallel: the mixer by heads with their B/C groups (core/model/mamba2.py;
`mamba_n_groups` must split over the ranks), attention and MLP as llama's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.model.base import CausalLM, DecoderModel
from tokenmill.model.family import ModelFamily, shrink_config
from tokenmill.model.layers import (
    Attention,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    add_norm,
    rotary_from_config,
)
from tokenmill.model.linear import LayerBuilder
from tokenmill.model.mamba2 import Mamba2Mixer, mamba2_dims
from tokenmill.model.parallel import check_divides
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.ops.mamba2 import mamba2_state_spec

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
        self, hf_config: Any, spec: AttentionSpec, rotary: RotaryEmbedding,
        backend: AttentionBackend, build: LayerBuilder, prefix: str,
    ) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.is_mamba = spec.kind == AttentionKind.LINEAR
        if self.is_mamba:
            self.mamba = Mamba2Mixer(
                hidden, mamba2_dims(hf_config), backend=backend, spec=spec, eps=eps,
                conv_bias=bool(hf_config.mamba_conv_bias),
                proj_bias=bool(hf_config.mamba_proj_bias), build=build, prefix=f"{prefix}.mamba",
            )
        else:
            bias = bool(getattr(hf_config, "attention_bias", False))
            self.self_attn = Attention(
                hidden_size=hidden, spec=spec, rotary=rotary, backend=backend, build=build,
                prefix=f"{prefix}.self_attn", qkv_bias=bias, o_bias=bias, qk_norm_eps=None,
            )
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        self.mlp = GatedMLP(hidden, hf_config.intermediate_size, mlp_bias, build, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hidden, eps, build.ops, build.dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, build.ops, build.dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: Any,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_norm(self.input_layernorm, hidden, residual)
        if self.is_mamba:
            hidden = self.mamba(hidden, kv_cache, metadata)
        else:
            hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class BambaModel(DecoderModel):
    """Embedding, Bamba's layers, final norm; the rotary table is sized by the attention
    layers' heads (from the config: a pipeline stage may hold no attention layer)."""

    def setup(self, hf_config: Any, specs: list[AttentionSpec], build: LayerBuilder) -> None:
        self.rotary_emb = rotary_from_config(hf_config, build.ops)

    def make_layer(
        self, hf_config: Any, index: int, spec: AttentionSpec, backend: AttentionBackend,
        build: LayerBuilder, prefix: str,
    ) -> nn.Module:
        return BambaDecoderLayer(hf_config, spec, self.rotary_emb, backend, build, prefix)


class BambaForCausalLM(CausalLM):
    """Bamba over the recurrent-state and paged KV arena; see the module docstring."""

    body_cls = BambaModel

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        for old, new in _RENAMES:
            hf_name = hf_name.replace(old, new)
        if hf_name.endswith(".mamba.conv1d.weight"):
            tensor = tensor.squeeze(1)  # [C, 1, K] -> [C, K]
        yield from super()._convert(hf_name, tensor)


def shrink_mamba_heads(local: Any, hf_config: Any, tp: int) -> None:
    """Mamba2 heads split with the B/C groups they read."""
    check_divides(tp, hf_config.mamba_n_groups, "the model's Mamba2 groups")
    check_divides(tp, hf_config.mamba_n_heads, "the model's Mamba2 heads")
    local.mamba_n_heads = hf_config.mamba_n_heads // tp
    local.mamba_n_groups = hf_config.mamba_n_groups // tp


def tiny(hf_config: Any) -> Any:
    """A Mamba2 layer then a full-attention one; SSD chunks of 8."""
    return shrink_config(
        hf_config, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_d_head=16,
        mamba_chunk_size=8, max_position_embeddings=512,
    )


FAMILY = ModelFamily(
    name="bamba",
    model_types=("bamba",),
    model=BambaForCausalLM,
    attention_specs=bamba_attention_specs,
    tp_shrink=shrink_mamba_heads,
    sequence_parallel=False,  # the Mamba2 mixer is not wired for token slices
    final_norm="model.final_layernorm.",
    tiny=tiny,
)
