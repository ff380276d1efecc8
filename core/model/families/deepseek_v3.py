"""DeepSeek-V3 (HF model_type "deepseek_v3"): multi-head latent attention and a
mixture of experts with shared experts.

What differs from the llama graph (families/llama.py; the weight loading is the base's):

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

Tensor parallel (core/model/parallel.py): MLA split by heads (core/model/mla.py: q / q_b
and kv_b rows, o_proj columns; the latent path and the latent cache replicated on every
rank, as vLLM does), the dense MLPs and the shared experts by their intermediate dim, the
routed experts by theirs or, with `enable_expert_parallel`, whole per rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.model.base import CausalLM, DecoderModel
from tokenmill.model.draft import DraftBase, head_logits
from tokenmill.model.family import ModelFamily, shrink_config
from tokenmill.model.layers import (
    BackendChoice,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    add_norm,
    resolve_backends,
    rope_parameters,
)
from tokenmill.model.linear import LayerBuilder
from tokenmill.model.mla import MLAAttention, mla_spec
from tokenmill.model.moe import FusedMoE, expert_param
from tokenmill.model.parallel import check_divides
from tokenmill.platforms.interfaces import AttentionBackend, AttentionMetadata, AttentionSpec

_LAYER = re.compile(r"model\.layers\.(\d+)\.")

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


def make_moe(hf_config: Any, build: LayerBuilder, prefix: str) -> FusedMoE:
    """DeepSeek-V3's (and Kimi Linear's) routed + shared experts; under tensor parallel
    the shared experts are built at this rank's slice of their intermediate dim and left
    unreduced (their partial sum joins the routed experts' reduction); the routed ones
    split themselves (FusedMoE)."""
    hidden, inter = hf_config.hidden_size, hf_config.moe_intermediate_size
    shared = None
    if getattr(hf_config, "n_shared_experts", 0):
        shared_inter = inter * hf_config.n_shared_experts // build.tp.world_size
        shared = GatedMLP(hidden, shared_inter, False, build, f"{prefix}.shared_experts",
                          partial=True)
    return FusedMoE(
        hidden_size=hidden, intermediate_size=inter,
        num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
        routing="sigmoid_group_topk", renormalize=bool(hf_config.norm_topk_prob),
        activation="silu", router_bias=False, expert_bias=False, build=build, prefix=prefix,
        num_groups=hf_config.n_group or 1, topk_group=hf_config.topk_group or 1,
        routed_scaling_factor=hf_config.routed_scaling_factor, shared_experts=shared,
        shared_partial=shared is not None,
    )


class MLADecoderLayer(nn.Module):
    """Pre-norm block: MLA (or another mixer), then a dense MLP or the MoE (`moe`)."""

    def __init__(self, hf_config: Any, attention: nn.Module, moe: bool, build: LayerBuilder,
                 prefix: str) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = attention
        self.mlp = (make_moe(hf_config, build, f"{prefix}.mlp") if moe
                    else GatedMLP(hidden, hf_config.intermediate_size, False, build,
                                  f"{prefix}.mlp"))
        self.input_layernorm = RMSNorm(hidden, eps, build.ops, build.dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, build.ops, build.dtype)

    def forward(self, positions, hidden, residual, kv_cache, metadata):
        hidden, residual = add_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV3Model(DecoderModel):
    """Embedding, MLA decoder layers, final norm (HF's `model.` prefix)."""

    def setup(self, hf_config: Any, specs: list[AttentionSpec], build: LayerBuilder) -> None:
        self.rotary_emb = RotaryEmbedding(
            rope_parameters(hf_config), hf_config.qk_rope_head_dim,
            hf_config.max_position_embeddings, build.ops,
        )

    def make_layer(
        self, hf_config: Any, index: int, spec: AttentionSpec, backend: AttentionBackend,
        build: LayerBuilder, prefix: str,
    ) -> nn.Module:
        attention = MLAAttention(
            hf_config=hf_config, spec=spec, rotary=self.rotary_emb,
            rope_interleave=bool(getattr(hf_config, "rope_interleave", True)), backend=backend,
            build=build, prefix=f"{prefix}.self_attn",
        )
        moe = index >= hf_config.first_k_dense_replace
        return MLADecoderLayer(hf_config, attention, moe, build, prefix)


def convert_moe_name(hf_name: str) -> str | None:
    """Our name of a MoE layer's checkpoint tensor (`model.layers.N.mlp.<leaf>`), else None."""
    prefix, sep, leaf = hf_name.partition(".mlp.")
    if sep and leaf in _MOE_NAMES:
        return f"{prefix}.mlp.{_MOE_NAMES[leaf]}"
    return None


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 over a paged latent cache; see the module docstring for what differs."""

    body_cls = DeepseekV3Model

    def _mtp_weight(self, hf_name: str) -> bool:
        """Whether `hf_name` is a multi-token-prediction module's (`model.layers.{i}.`, i
        past the decoder layers): speculative decoding's draft (core/spec_decode/
        draft_models.py) loads those; the target skips them, as transformers does."""
        match = _LAYER.match(hf_name)
        return match is not None and int(match.group(1)) >= self.hf_config.num_hidden_layers

    @classmethod
    def expert_name(cls, hf_name: str) -> tuple[str, int | None] | None:
        prefix, sep, leaf = hf_name.partition(".mlp.experts.")
        return expert_param(f"{prefix}.mlp", leaf) if sep else None

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        if self._mtp_weight(hf_name):
            return
        expert = self.expert_name(hf_name)
        if expert is not None:  # per expert (or stacked): FusedMoE narrows to this rank's share
            yield *expert, tensor
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


def deepseek_v3_specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    """Every layer MLA."""
    spec = mla_spec(hf_config, dtype, block_size, softmax_scale(hf_config))
    return [spec] * hf_config.num_hidden_layers


def check_shared_experts(local: Any, hf_config: Any, tp: int) -> None:
    """The shared experts split by their intermediate dim (built at the rank's share by
    `make_moe`, from the whole config's sizes)."""
    shared = hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0)
    check_divides(tp, shared, "the shared experts' intermediate size")


def tiny(hf_config: Any) -> Any:
    """MLA (a q LoRA, a decoupled rope key), one dense layer then MoE with a shared
    expert and group-limited sigmoid routing (4 groups of 2, top 2 groups)."""
    return shrink_config(
        hf_config, num_hidden_layers=3, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32,
        n_shared_experts=1, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512,
    )


# ---- DeepSeek-V3 multi-token prediction ----------------------------------------------------
class MTPLayer(MLADecoderLayer):
    """One MTP module; parameter names are the checkpoint's under `model.layers.{N}.`."""

    def __init__(self, hf_config: Any, attention: MLAAttention, moe: bool, build: LayerBuilder,
                 prefix: str) -> None:
        super().__init__(hf_config, attention, moe, build, prefix)
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.embed_tokens = build.embedding(f"{prefix}.embed_tokens", hf_config.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, eps, build.ops, build.dtype)
        self.hnorm = RMSNorm(hidden, eps, build.ops, build.dtype)
        self.eh_proj = build.replicated(f"{prefix}.eh_proj", 2 * hidden, hidden, False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps, build.ops, build.dtype)
        self.shared_head.head = build.lm_head(f"{prefix}.shared_head.head", hidden,
                                              hf_config.vocab_size)

    def predict(self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        embeds = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(embeds), embeds)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous)], dim=-1))
        hidden, residual = super().forward(positions, x, None, kv_cache, metadata)
        return hidden + residual


class DeepseekMTP(DraftBase, DeepseekV3ForCausalLM):
    """DeepSeek-V3's first MTP module as a draft model (see the module docstring)."""

    def __init__(self, hf_config: Any, build: LayerBuilder, attention_backend: BackendChoice,
                 block_size: int) -> None:
        nn.Module.__init__(self)
        self._init_loading(hf_config, build)
        index = hf_config.num_hidden_layers
        self.attention_specs = self.specs(hf_config, build.dtype, block_size)
        self.layer_backends = resolve_backends(self.attention_specs, attention_backend)
        self.rotary_emb = RotaryEmbedding(
            rope_parameters(hf_config), hf_config.qk_rope_head_dim,
            hf_config.max_position_embeddings, build.ops,
        )
        prefix = f"model.layers.{index}"
        attention = MLAAttention(
            hf_config=hf_config, spec=self.attention_specs[0], rotary=self.rotary_emb,
            rope_interleave=bool(getattr(hf_config, "rope_interleave", True)),
            backend=self.layer_backends[0], build=build, prefix=f"{prefix}.self_attn",
        )
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(index): MTPLayer(
            hf_config, attention, index >= hf_config.first_k_dense_replace, build, prefix)})
        self.layer = self.model.layers[str(index)]
        self.requires_grad_(False)

    def _mtp_weight(self, hf_name: str) -> bool:
        return False  # the draft loads exactly those

    @staticmethod
    def specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
        """The MTP layer's: the model's MLA spec."""
        return deepseek_v3_specs(hf_config, dtype, block_size)[:1]

    @staticmethod
    def weight_filter(hf_config: Any):
        prefix = f"model.layers.{hf_config.num_hidden_layers}."
        return lambda name: name.startswith(prefix)

    def first_hidden(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        return hidden

    def attach(self, target: nn.Module) -> None:
        """Nothing of the target's: the module has its own embedding and head."""

    def forward(self, input_ids, positions, hidden, kv_caches, metadata):
        """(hidden for the logits, hidden for a chained step): both g_p here."""
        out = self.layer.predict(input_ids, positions, hidden, kv_caches[0], metadata)
        return out, out

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.layer.shared_head
        logits = head_logits(head.head, head.norm(hidden), self.hf_config.vocab_size, self.tp)
        return logits.argmax(dim=-1)


FAMILY = ModelFamily(
    mtp=DeepseekMTP,
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    model=DeepseekV3ForCausalLM,
    attention_specs=deepseek_v3_specs,
    tp_shrink=check_shared_experts,
    moe=("moe_intermediate_size", "n_routed_experts"),
    tiny=tiny,
)
