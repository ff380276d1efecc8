"""Qwen3-MoE (HF model_type "qwen3_moe"): Qwen3's attention (per-head q/k norm, the
config's head_dim) with a mixture of experts in place of the dense MLP.

A layer's MLP is sparse when `num_experts > 0`, the layer is not in `mlp_only_layers` and
`(layer + 1) % decoder_sparse_step == 0` (transformers' rule); other layers keep a dense
MLP of `intermediate_size`. The sparse one is a `FusedMoE` of `num_experts` experts of
`moe_intermediate_size`, top `num_experts_per_tok` of a softmax over all experts,
renormalised when `norm_topk_prob`; no biases.

Checkpoints name the router `mlp.gate` and store each expert's projections separately
(`mlp.experts.{e}.gate_proj / up_proj / down_proj`), or stacked (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]) as transformers 5 holds them in memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.model.base import CausalLM, attention_specs
from tokenmill.model.families.llama import DecoderLayer, Model
from tokenmill.model.family import ModelFamily, shrink_config
from tokenmill.model.linear import LayerBuilder
from tokenmill.model.moe import FusedMoE, expert_param


def is_sparse_layer(hf_config: Any, layer_index: int) -> bool:
    """Whether layer `layer_index` has experts (transformers' Qwen3-MoE rule)."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (
        hf_config.num_experts > 0
        and layer_index not in (getattr(hf_config, "mlp_only_layers", None) or [])
        and (layer_index + 1) % step == 0
    )


class Qwen3MoeDecoderLayer(DecoderLayer):
    def qk_norm(self, hf_config: Any) -> bool:
        return True  # Qwen3's attention

    def _make_mlp(self, hf_config: Any, build: LayerBuilder, prefix: str) -> nn.Module:
        if not is_sparse_layer(hf_config, self.layer_index):
            return super()._make_mlp(hf_config, build, prefix)
        return FusedMoE(
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.moe_intermediate_size,
            num_experts=hf_config.num_experts,
            top_k=hf_config.num_experts_per_tok,
            routing="softmax_topk",
            renormalize=bool(hf_config.norm_topk_prob),
            activation="silu",
            router_bias=False,
            expert_bias=False,
            build=build,
            prefix=prefix,
        )


class Qwen3MoeModel(Model):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE over a paged KV cache; see the module docstring."""

    body_cls = Qwen3MoeModel

    @classmethod
    def expert_name(cls, hf_name: str) -> tuple[str, int | None] | None:
        prefix, sep, leaf = hf_name.partition(".mlp.experts.")
        return expert_param(f"{prefix}.mlp", leaf) if sep else None

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        if ".mlp.gate." in hf_name:
            yield hf_name.replace(".mlp.gate.", ".mlp.router."), None, tensor
            return
        expert = self.expert_name(hf_name)
        if expert is not None:
            yield *expert, tensor
            return
        yield from super()._convert(hf_name, tensor)


def tiny(hf_config: Any) -> Any:
    """4 experts of 32, top 2 renormalised; layer 1 keeps a dense MLP."""
    return shrink_config(
        hf_config, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
        max_position_embeddings=512,
    )


FAMILY = ModelFamily(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    model=Qwen3MoeForCausalLM,
    attention_specs=attention_specs,
    moe=("moe_intermediate_size", "num_experts"),
    tiny=tiny,
)
