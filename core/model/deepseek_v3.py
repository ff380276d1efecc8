"""DeepSeek-V3 (HF model_type "deepseek_v3"): multi-head latent attention and a
mixture of experts with shared experts.

What differs from the llama graph (core/model/llama.py, whose weight loading it reuses):

- every attention layer is MLA (core/model/mla.py): the KV cache holds one latent row per
  token (kv_lora_rank + qk_rope_head_dim values, `AttentionKind.MLA`), rotary on the
  qk_rope_head_dim channels only, interleaved pairs (`rope_interleave`), softmax scale
  qk_head_dim ** -0.5 times YaRN's mscale(factor, mscale_all_dim) ** 2 when rope is
  scaled;
- the first `first_k_dense_replace` layers have a dense gated MLP, the others a
  `FusedMoE`: a float32 router, sigmoid scores, group-limited top-k with the
  `e_score_correction_bias` ("sigmoid_group_topk"), weights renormalised
  (`norm_topk_prob`) and scaled by `routed_scaling_factor`, plus `n_shared_experts`
  shared experts (one gated MLP of n_shared x moe_intermediate_size) on every token.
  Checkpoints store one tensor per expert (`experts.<e>.gate_proj.weight`, ...), each
  loaded straight into its rows of the op's layout (`FusedMoE.load_checkpoint_tensor`,
  which skips another rank's experts); transformers' fused in-memory names
  (`experts.gate_up_proj` [E, 2I, H], gate rows then up, and `experts.down_proj`
  [E, H, I]) are the op's layout already and load as they are.

Tensor parallel (core/model/parallel.py): MLA split by heads (`MLAAttention.shard_for_tp`:
q / q_b and kv_b rows, o_proj columns; the latent path and the latent cache replicated
on every rank, as vLLM does), the dense MLPs and the shared experts by their intermediate
dim, the routed experts by theirs or, with `enable_expert_parallel`, whole per rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.distributed.parallel_state import get_parallel_state
from tokenmill.model.layers import (
    Embedding,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    rope_parameters,
)
from tokenmill.model.llama import CausalLM
from tokenmill.model.mla import MLAAttention, mla_spec
from tokenmill.model.moe import FusedMoE
from tokenmill.model.qwen3_moe import convert_expert_tensor
from tokenmill.ops import Ops
from tokenmill.platforms.interfaces import AttentionBackend, AttentionMetadata, AttentionSpec

# checkpoint name inside a MoE layer's `mlp.` -> our parameter
_MOE_NAMES = {
    "gate.weight": "router.weight",
    "gate.e_score_correction_bias": "e_score_correction_bias",
}


def softmax_scale(hf_config: Any) -> float:
    """qk_head_dim ** -0.5, times mscale ** 2 under scaled rope (transformers'
    yarn_apply_mscale)."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf_config)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and mscale_all_dim and params["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def make_moe(hf_config: Any, ops: Ops, dtype: torch.dtype) -> FusedMoE:
    """DeepSeek-V3's (and Kimi Linear's) routed + shared experts; under tensor parallel
    the shared experts are built at this rank's slice of their intermediate dim (the
    routed ones split themselves: FusedMoE)."""
    hidden, inter = hf_config.hidden_size, hf_config.moe_intermediate_size
    shared = None
    if getattr(hf_config, "n_shared_experts", 0):
        tp = get_parallel_state().tp.world_size
        shared = GatedMLP(hidden, inter * hf_config.n_shared_experts // tp, False, ops, dtype)
    return FusedMoE(
        hidden_size=hidden, intermediate_size=inter,
        num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
        routing="sigmoid_group_topk", renormalize=bool(hf_config.norm_topk_prob),
        activation="silu", router_bias=False, expert_bias=False, ops=ops, dtype=dtype,
        num_groups=hf_config.n_group or 1, topk_group=hf_config.topk_group or 1,
        routed_scaling_factor=hf_config.routed_scaling_factor, shared_experts=shared,
    )


class MLADecoderLayer(nn.Module):
    """Pre-norm block: MLA, then a dense MLP or the MoE (`moe`)."""

    def __init__(self, hf_config: Any, attention: nn.Module, moe: bool, ops: Ops,
                 dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = attention
        self.mlp = (make_moe(hf_config, ops, dtype) if moe
                    else GatedMLP(hidden, hf_config.intermediate_size, False, ops, dtype))
        self.input_layernorm = RMSNorm(hidden, eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops, dtype)

    def forward(self, positions, hidden, residual, kv_cache, metadata):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV3Model(nn.Module):
    """Embedding, MLA decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(self, hf_config: Any, specs: list[AttentionSpec],
                 backends: list[AttentionBackend], ops: Ops, dtype: torch.dtype,
                 first_layer: int = 0) -> None:
        super().__init__()
        self.rotary_emb = RotaryEmbedding(
            rope_parameters(hf_config), hf_config.qk_rope_head_dim,
            hf_config.max_position_embeddings, ops,
        )
        self.embed_tokens = Embedding(hf_config.vocab_size, hf_config.hidden_size, dtype)
        interleave = bool(getattr(hf_config, "rope_interleave", True))
        self.layers = nn.ModuleList(
            MLADecoderLayer(
                hf_config,
                MLAAttention(hf_config=hf_config, spec=spec, rotary=self.rotary_emb,
                             rope_interleave=interleave, backend=backend, ops=ops, dtype=dtype),
                moe=i >= hf_config.first_k_dense_replace, ops=ops, dtype=dtype,
            )
            for i, spec, backend in zip(range(first_layer, first_layer + len(specs)), specs,
                                        backends, strict=True)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, ops, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: list[AttentionMetadata]) -> torch.Tensor:
        sp = self.__dict__.get("sequence_parallel")  # tensor parallel's SequenceParallel
        if sp is not None:
            sp.num_tokens = input_ids.shape[0]
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metadata, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden if sp is None else sp.gather(hidden)


def convert_moe_name(hf_name: str) -> str | None:
    """Our name of a MoE layer's checkpoint tensor (`model.layers.N.mlp.<leaf>`), else None."""
    prefix, sep, leaf = hf_name.partition(".mlp.")
    if sep and leaf in _MOE_NAMES:
        return f"{prefix}.mlp.{_MOE_NAMES[leaf]}"
    return None


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 over a paged latent cache; see the module docstring for what differs."""

    @classmethod
    def attention_specs_for(
        cls, hf_config: Any, dtype: torch.dtype, block_size: int
    ) -> list[AttentionSpec]:
        spec = mla_spec(hf_config, dtype, block_size, softmax_scale(hf_config))
        return [spec] * hf_config.num_hidden_layers

    def _build_model(self, hf_config, specs, backends, ops, dtype) -> nn.Module:
        return DeepseekV3Model(hf_config, specs, backends, ops, dtype, self.first_layer)

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        prefix, sep, leaf = hf_name.partition(".mlp.experts.")
        if sep:  # per expert (or stacked): FusedMoE narrows to this rank's share
            converted = list(convert_expert_tensor(f"{prefix}.mlp", leaf, tensor))
            if converted:
                yield from converted
                return
        name = convert_moe_name(hf_name)
        if name is not None:
            yield name, None, tensor
            return
        if hf_name.endswith(".self_attn.q_proj.weight") and not hasattr(
            self.get_submodule(hf_name.rsplit(".", 2)[0]), "qkv_proj"
        ):
            yield hf_name, None, tensor  # MLA's q_proj is not fused with k and v
            return
        yield from super()._convert(hf_name, tensor)
