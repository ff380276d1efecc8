"""Mixtral (HF model_type "mixtral"): llama attention with a mixture of experts in every
layer, and an optional sliding window on every layer.

The MoE is a `FusedMoE` of `num_local_experts` experts of `intermediate_size`, top
`num_experts_per_tok` of a softmax over all experts, always renormalised; no biases.
Checkpoints name it `block_sparse_moe`, its router `gate` and each expert's projections
`w1` (gate), `w3` (up) and `w2` (down); transformers 5 names it `mlp`, with stacked
`experts.gate_up_proj` / `experts.down_proj`. Both load.
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
from tokenmill.model.moe import FusedMoE, expert_param
from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec

_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralDecoderLayer(DecoderLayer):
    def _make_mlp(self, hf_config: Any, build: LayerBuilder, prefix: str) -> nn.Module:
        return FusedMoE(
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            routing="softmax_topk",
            renormalize=True,
            activation="silu",
            router_bias=False,
            expert_bias=False,
            build=build,
            prefix=prefix,
        )


class MixtralModel(Model):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(CausalLM):
    """Mixtral over a paged KV cache; see the module docstring."""

    body_cls = MixtralModel

    @classmethod
    def expert_name(cls, hf_name: str) -> tuple[str, int | None] | None:
        name = hf_name.replace(".block_sparse_moe.", ".mlp.")
        prefix, sep, leaf = name.partition(".mlp.experts.")
        if not sep:
            return None
        parts = leaf.split(".")
        if len(parts) == 3 and parts[1] in _EXPERT_PROJ:
            leaf = f"{parts[0]}.{_EXPERT_PROJ[parts[1]]}.{parts[2]}"
        return expert_param(f"{prefix}.mlp", leaf)

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        name = hf_name.replace(".block_sparse_moe.", ".mlp.")
        if ".mlp.gate." in name:
            yield name.replace(".mlp.gate.", ".mlp.router."), None, tensor
            return
        expert = self.expert_name(hf_name)
        if expert is not None:
            yield *expert, tensor
            return
        yield from super()._convert(name, tensor)


def mixtral_specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    """Full layers, or with `sliding_window` and no `layer_types`, every layer windowed
    (as transformers' Mixtral)."""
    specs = attention_specs(hf_config, dtype, block_size)
    window = getattr(hf_config, "sliding_window", None)
    if window is None or getattr(hf_config, "layer_types", None):
        return specs
    return [
        dataclasses.replace(s, kind=AttentionKind.SLIDING_WINDOW, sliding_window=window)
        for s in specs
    ]


def tiny(hf_config: Any) -> Any:
    """Two layers of 4 experts of 32, top 2."""
    return shrink_config(
        hf_config, num_hidden_layers=2, hidden_size=64, intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512,
    )


FAMILY = ModelFamily(
    name="mixtral",
    model_types=("mixtral",),
    model=MixtralForCausalLM,
    attention_specs=mixtral_specs,
    moe=("intermediate_size", "num_local_experts"),
    tiny=tiny,
)
