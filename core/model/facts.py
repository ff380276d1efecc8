"""What each layer of a model holds beyond its config's widths, read from the model itself.

A family decides things no config field states (Qwen2 biases q, k and v but not o;
Qwen3-Next's q projection carries a gate; Gemma 3 has four norms a layer; gpt-oss's
router and experts carry biases). Code that reasons about a model without running it
(the planner) reads them here, from the family's own model built on the meta device (no
memory, no weights), instead of keeping its own list of families.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tokenmill.model.layers import Attention, GemmaRMSNorm, RMSNorm
from tokenmill.model.moe import FusedMoE
from tokenmill.model.registry import family_for
from tokenmill.platforms.interfaces import AttentionBackend, AttentionKind, AttentionSpec
from tokenmill.platforms.ops import resolve_ops
from tokenmill.platforms.ops.linear_attention import ReferenceLinearAttentionBackend
from tokenmill.platforms.ops.mla import ReferenceMLABackend
from tokenmill.platforms.ops.reference import ReferenceAttentionBackend

_NORMS = (RMSNorm, GemmaRMSNorm)


@dataclasses.dataclass(frozen=True)
class LayerFacts:
    """One decoder layer's: its hidden-sized norms; for a multi-head attention layer,
    whether q/k/v and o carry biases, how many rows per head its q projection has (2:
    a gate rides with the query) and whether q and k are normalised per head; for a
    mixture of experts, whether its router and experts carry biases."""

    norms: int
    qkv_bias: bool = False
    o_bias: bool = False
    q_rows_per_head: int = 1
    qk_norm: bool = False
    experts_biased: bool = False


def layer_facts(hf_config: Any) -> list[LayerFacts]:
    """Every layer's facts, from `hf_config`'s family's model built on the meta device."""
    with torch.device("meta"):
        model = family_for(hf_config).model(
            hf_config, ops=resolve_ops(), attention_backend=_reference_backend,
            dtype=torch.bfloat16, block_size=16,
        )
    return [_facts_of(layer) for layer in model.model.layers]


def _reference_backend(spec: AttentionSpec) -> AttentionBackend:
    if spec.kind == AttentionKind.MLA:
        return ReferenceMLABackend()
    if spec.kind == AttentionKind.LINEAR:
        return ReferenceLinearAttentionBackend()
    return ReferenceAttentionBackend()


def _facts_of(layer: nn.Module) -> LayerFacts:
    children = list(layer.children())
    facts = LayerFacts(norms=sum(isinstance(c, _NORMS) for c in children))
    for module in layer.modules():
        if isinstance(module, Attention):
            head_rows = module.num_heads * module.head_size
            facts = dataclasses.replace(
                facts, qkv_bias=module.qkv_proj.bias is not None,
                o_bias=module.o_proj.bias is not None,
                q_rows_per_head=module.qkv_proj.output_sizes[0] // head_rows,
                qk_norm=module.q_norm is not None,
            )
        elif isinstance(module, FusedMoE):
            facts = dataclasses.replace(facts, experts_biased=module.w13_bias is not None)
    return facts
