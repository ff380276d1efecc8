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

from tokenmill.model.llama import CausalLM, DecoderLayer, Model
from tokenmill.model.moe import FusedMoE
from tokenmill.ops import Ops
from tokenmill.platforms.interfaces import AttentionBackend, AttentionSpec

# per-expert checkpoint projection -> (our FusedMoE parameter, part: 0 gate, 1 up, None down)
_PER_EXPERT = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}


def is_sparse_layer(hf_config: Any, layer_index: int) -> bool:
    """Whether layer `layer_index` has experts (transformers' Qwen3-MoE rule)."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (
        hf_config.num_experts > 0
        and layer_index not in (getattr(hf_config, "mlp_only_layers", None) or [])
        and (layer_index + 1) % step == 0
    )


class Qwen3MoeDecoderLayer(DecoderLayer):
    def _make_mlp(self, hf_config: Any, ops: Ops, dtype: torch.dtype) -> nn.Module:
        if not is_sparse_layer(hf_config, self.layer_index):
            return super()._make_mlp(hf_config, ops, dtype)
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
            ops=ops,
            dtype=dtype,
        )


def convert_expert_tensor(
    prefix: str, leaf: str, tensor: torch.Tensor
) -> Iterator[tuple[str, int | None, torch.Tensor]]:
    """`{prefix}.experts.{e}.{proj}.weight` or `{prefix}.experts.{stacked}` -> FusedMoE
    parameters under `prefix` (shard numbering: FusedMoE.checkpoint_shards); nothing for
    other names. `leaf` is the name after `{prefix}.experts.`."""
    parts = leaf.split(".")
    if len(parts) == 3 and parts[0].isdigit() and parts[1] in _PER_EXPERT and parts[2] == "weight":
        param, part = _PER_EXPERT[parts[1]]
        expert = int(parts[0])
        shard = expert if part is None else 2 * expert + part
        yield f"{prefix}.{param}", shard, tensor
    elif len(parts) == 1 and parts[0] in _STACKED:
        yield f"{prefix}.{_STACKED[parts[0]]}", None, tensor


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE over a paged KV cache; see the module docstring."""

    def _build_model(
        self,
        hf_config: Any,
        specs: list[AttentionSpec],
        backends: list[AttentionBackend],
        ops: Ops,
        dtype: torch.dtype,
    ) -> nn.Module:
        return Model(hf_config, specs, backends, ops, dtype, layer_cls=Qwen3MoeDecoderLayer,
                     first_layer=self.first_layer)

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        if ".mlp.gate." in hf_name:
            yield hf_name.replace(".mlp.gate.", ".mlp.router."), None, tensor
            return
        prefix, sep, leaf = hf_name.partition(".mlp.experts.")
        if sep:
            converted = list(convert_expert_tensor(f"{prefix}.mlp", leaf, tensor))
            if converted:
                yield from converted
                return
        yield from super()._convert(hf_name, tensor)
