"""gpt-oss (HF model_type "gpt_oss"): sliding-window and full attention layers, both with
attention sinks, and a mixture-of-experts MLP in every layer.

What differs from the llama graph (families/llama.py, whose layer, attention and
weight loading it reuses):

- every attention layer has learned per-head sink logits (`self_attn.sinks`, see
  `AttentionSpec.sinks`); q/k/v and o carry biases (`attention_bias`);
- `layer_types` interleave sliding-window (`sliding_window` tokens) and full layers;
- rotary embeddings use YaRN scaling (`rope_type: yarn`, cos/sin times its factor);
- the MLP is a `FusedMoE`: a biased router, top-k of the logits softmaxed over those k,
  experts with biases and gpt-oss's clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`).
  The checkpoint stacks experts as `gate_up_proj` [E, H, 2I] with gate and up columns
  interleaved and `down_proj` [E, I, H]; `_convert` transposes them to the op's layout
  and separates gate from up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.model.base import CausalLM, attention_specs
from tokenmill.model.families.llama import DecoderLayer, Model
from tokenmill.model.family import ModelFamily, shrink_config
from tokenmill.model.linear import LayerBuilder
from tokenmill.model.moe import FusedMoE, deinterleave_gate_up
from tokenmill.platforms.interfaces import AttentionSpec

# checkpoint expert tensor -> (our FusedMoE parameter, conversion)
_EXPERT_TENSORS = {
    "gate_up_proj": ("w13", lambda t: deinterleave_gate_up(t.transpose(1, 2), dim=1)),
    "gate_up_proj_bias": ("w13_bias", lambda t: deinterleave_gate_up(t, dim=1)),
    "down_proj": ("w2", lambda t: t.transpose(1, 2)),
    "down_proj_bias": ("w2_bias", lambda t: t),
}


class GptOssDecoderLayer(DecoderLayer):
    """The llama layer with a mixture of experts in place of the dense MLP."""

    def _make_mlp(self, hf_config: Any, build: LayerBuilder, prefix: str) -> nn.Module:
        return FusedMoE(
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            routing="topk_softmax",
            renormalize=False,
            activation="swiglu_oai",
            router_bias=True,
            expert_bias=True,
            build=build,
            prefix=prefix,
            swiglu_alpha=hf_config.swiglu_alpha,
            swiglu_limit=hf_config.swiglu_limit,
        )


class GptOssModel(Model):
    layer_cls = GptOssDecoderLayer


class GptOssForCausalLM(CausalLM):
    """gpt-oss over a paged KV cache; see the module docstring for what differs."""

    body_cls = GptOssModel

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        prefix, _, leaf = hf_name.rpartition(".")
        if prefix.endswith(".mlp.experts") and leaf in _EXPERT_TENSORS:
            param, convert = _EXPERT_TENSORS[leaf]
            yield f"{prefix.removesuffix('.experts')}.{param}", None, convert(tensor)
            return
        yield from super()._convert(hf_name, tensor)


def gpt_oss_specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    """Sliding and full layers, every one with sinks."""
    return [
        dataclasses.replace(s, sinks=True) for s in attention_specs(hf_config, dtype, block_size)
    ]


def tiny(hf_config: Any) -> Any:
    """A sliding layer (window 8) then a full one; 4 experts of 32, top 2."""
    return shrink_config(
        hf_config, num_hidden_layers=2, hidden_size=64, intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
    )


FAMILY = ModelFamily(
    name="gpt_oss",
    model_types=("gpt_oss",),
    model=GptOssForCausalLM,
    attention_specs=gpt_oss_specs,
    moe=("intermediate_size", "num_local_experts"),
    tiny=tiny,
)
