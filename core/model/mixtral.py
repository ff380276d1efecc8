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

from tokenmill.model.llama import CausalLM, DecoderLayer, Model, attention_specs
from tokenmill.model.moe import FusedMoE
from tokenmill.model.qwen3_moe import convert_expert_tensor
from tokenmill.ops import Ops
from tokenmill.platforms.interfaces import AttentionBackend, AttentionKind, AttentionSpec

_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralDecoderLayer(DecoderLayer):
    def _make_mlp(self, hf_config: Any, ops: Ops, dtype: torch.dtype) -> nn.Module:
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
            ops=ops,
            dtype=dtype,
        )


class MixtralForCausalLM(CausalLM):
    """Mixtral over a paged KV cache; see the module docstring."""

    @classmethod
    def attention_specs_for(
        cls, hf_config: Any, dtype: torch.dtype, block_size: int
    ) -> list[AttentionSpec]:
        specs = attention_specs(hf_config, dtype, block_size)
        window = getattr(hf_config, "sliding_window", None)
        if window is None or getattr(hf_config, "layer_types", None):
            return specs
        # no layer_types: transformers' Mixtral windows every layer
        return [
            dataclasses.replace(s, kind=AttentionKind.SLIDING_WINDOW, sliding_window=window)
            for s in specs
        ]

    def _build_model(
        self,
        hf_config: Any,
        specs: list[AttentionSpec],
        backends: list[AttentionBackend],
        ops: Ops,
        dtype: torch.dtype,
    ) -> nn.Module:
        return Model(hf_config, specs, backends, ops, dtype, layer_cls=MixtralDecoderLayer,
                     first_layer=self.first_layer)

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        name = hf_name.replace(".block_sparse_moe.", ".mlp.")
        if ".mlp.gate." in name:
            yield name.replace(".mlp.gate.", ".mlp.router."), None, tensor
            return
        prefix, sep, leaf = name.partition(".mlp.experts.")
        if sep:
            parts = leaf.split(".")
            if len(parts) == 3 and parts[1] in _EXPERT_PROJ:
                leaf = f"{parts[0]}.{_EXPERT_PROJ[parts[1]]}.{parts[2]}"
            converted = list(convert_expert_tensor(f"{prefix}.mlp", leaf, tensor))
            if converted:
                yield from converted
                return
        yield from super()._convert(name, tensor)
