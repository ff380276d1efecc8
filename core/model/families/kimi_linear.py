"""Kimi Linear (HF model_type "kimi_linear"): Kimi Delta Attention layers and MLA layers,
DeepSeek-V3's MoE.

- `layer_types[i]` "linear_attention": a KDA layer (kind LINEAR, variant "kda" of the
  platform's linear-attention backend; reference `tokenmill.platforms.ops.linear_attention`): q, k,
  v projections (fused), a depthwise causal conv with SiLU, a per-channel forget gate
  g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), beta = sigmoid(b_proj(x)), the
  per-channel gated delta rule over a recurrent state kept in the KV arena (checkpoints
  store q, k, v convs separately: `q_conv1d`...), then a gated RMS norm (weight, times sigmoid(g_b(g_a(x)))) per head and o_proj;
- "full_attention": MLA (core/model/mla.py) with no rotary (NoPE), softmax scale
  qk_head_dim ** -0.5;
- `mlp_layer_types[i]` "dense" (gated MLP) or "sparse" (`deepseek_v3.make_moe`: sigmoid
  group-limited routing with the correction bias, shared experts).

Tensor parallel: KDA by heads (each head's channels are contiguous in every per-channel
tensor: a rank keeps its heads' rows of q, k, v, f_b, g_b and b_proj, its channels of the
three convs and dt_bias, its heads of A_log, o_proj's columns, which all-reduces; the
low-rank f_a / g_a and the per-head o_norm replicated; the recurrent state holds the
rank's heads only), MLA and the MoE as DeepSeek-V3's (families/deepseek_v3.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.model.base import DecoderModel
from tokenmill.model.families.deepseek_v3 import (
    DeepseekV3ForCausalLM,
    MLADecoderLayer,
    check_shared_experts,
)
from tokenmill.model.family import ModelFamily, shrink_config
from tokenmill.model.linear import LayerBuilder
from tokenmill.model.mla import MLAAttention, mla_spec
from tokenmill.model.parallel import Slice, check_divides
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.ops.linear_attention import KDAInputs, kda_state_spec

_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def kda_spec(hf_config: Any, dtype: torch.dtype, block_size: int) -> AttentionSpec:
    heads, dim = hf_config.linear_num_heads, hf_config.linear_head_dim
    return AttentionSpec(
        kind=AttentionKind.LINEAR, num_heads=heads, num_kv_heads=heads, head_size=dim,
        dtype=dtype, block_size=block_size,
        state=kda_state_spec(heads, dim, hf_config.linear_conv_kernel_dim, dtype),
    )


class _Conv(nn.Module):
    """Holds a depthwise conv's weight [C, 1, K] under HF's name `<x>_conv1d.weight`
    (`channels`: the rank's, whose checkpoint rows `shard_rules` names)."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype, shard_rules: dict) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype))
        self.shard_rules = shard_rules


class KimiDeltaAttention(nn.Module):
    """A KDA layer over the platform's linear-attention backend (see the module doc)."""

    def __init__(self, hf_config: Any, spec: AttentionSpec, backend: AttentionBackend,
                 build: LayerBuilder, prefix: str) -> None:
        super().__init__()
        dtype, hidden = build.dtype, hf_config.hidden_size
        heads, dim = hf_config.linear_num_heads, hf_config.linear_head_dim  # the rank's heads
        size = heads * dim
        self.spec, self.heads, self.dim = spec, heads, dim
        self.eps = hf_config.rms_norm_eps
        rank = build.tp.rank_in_group
        channels, own_heads = Slice(0, rank * size, size), Slice(0, rank * heads, heads)
        self.qkv_proj = build.column(f"{prefix}.qkv_proj", hidden, [size, size, size], False,
                                     shards=[channels] * 3)
        kernel = hf_config.linear_conv_kernel_dim
        conv_rules = build.rules({"weight": channels})
        self.q_conv1d = _Conv(size, kernel, dtype, conv_rules)
        self.k_conv1d = _Conv(size, kernel, dtype, conv_rules)
        self.v_conv1d = _Conv(size, kernel, dtype, conv_rules)
        # the forget gate: g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) per channel
        self.f_a_proj = build.replicated(f"{prefix}.f_a_proj", hidden, dim, False)
        self.f_b_proj = build.column(f"{prefix}.f_b_proj", dim, size, False, shards=channels)
        self.dt_bias = nn.Parameter(torch.empty(size, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(1, 1, heads, 1, dtype=torch.float32))
        self.b_proj = build.column(f"{prefix}.b_proj", hidden, heads, False, shards=own_heads)
        self.g_a_proj = build.replicated(f"{prefix}.g_a_proj", hidden, dim, False)
        self.g_b_proj = build.column(f"{prefix}.g_b_proj", dim, size, False, shards=channels)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.o_proj = build.row(f"{prefix}.o_proj", size, hidden, False)
        self.shard_rules = build.rules(
            {"dt_bias": channels, "A_log": Slice(2, rank * heads, heads)}
        )
        self.backend = backend

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [T, H, d] log decay, as transformers' KimiLinearForgetGate."""
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(
            -1, self.heads, self.dim
        )
        softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        return -self.A_log.float().exp()[0] * softplus

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        conv_weight = torch.cat(
            (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        )[:, 0]
        inputs = KDAInputs(
            mixed_qkv=self.qkv_proj(hidden), g=self.forget_gate(hidden),
            beta=torch.sigmoid(self.b_proj(hidden)), conv_weight=conv_weight,
            num_heads=self.heads, head_dim=self.dim,
        )
        out = self.backend.forward(self.spec, inputs, kv_cache, metadata)  # [T, H, d]
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(-1, self.heads, self.dim)
        # gated RMS norm per head, float32 throughout (transformers' KimiLinearRMSNormGated)
        x = out.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.o_norm.weight.float() * x * torch.sigmoid(gate.float())
        return self.o_proj(x.to(hidden.dtype).reshape(-1, self.heads * self.dim))


class KimiLinearModel(DecoderModel):
    """Embedding, KDA and MLA decoder layers, final norm (HF's `model.` prefix)."""

    def make_layer(
        self, hf_config: Any, index: int, spec: AttentionSpec, backend: AttentionBackend,
        build: LayerBuilder, prefix: str,
    ) -> nn.Module:
        if spec.kind == AttentionKind.MLA:
            attention = MLAAttention(hf_config=hf_config, spec=spec, rotary=None,
                                     rope_interleave=False, backend=backend, build=build,
                                     prefix=f"{prefix}.self_attn")
        else:
            attention = KimiDeltaAttention(hf_config, spec, backend, build, f"{prefix}.self_attn")
        moe = hf_config.mlp_layer_types[index] == "sparse"
        return MLADecoderLayer(hf_config, attention, moe, build, prefix)


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    """Kimi Linear over the KV arena (latent pages for MLA, state slots for KDA)."""

    body_cls = KimiLinearModel

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        """Kimi's checkpoints name the MLP `block_sparse_moe` and the experts' gate, down
        and up projections w1, w2, w3."""
        name = hf_name.replace(".block_sparse_moe.", ".mlp.")
        prefix, sep, leaf = name.rpartition(".experts.")
        if sep:
            expert, _, rest = leaf.partition(".")
            proj, _, param = rest.partition(".")
            if expert.isdigit() and proj in _EXPERT_PROJ:
                name = f"{prefix}.experts.{expert}.{_EXPERT_PROJ[proj]}.{param}"
        yield from super()._convert(name, tensor)


def kimi_linear_specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    """MLA for "full_attention" layers, KDA (LINEAR) for "linear_attention" ones."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    specs = []
    for i, layer_type in enumerate(hf_config.layer_types):
        if layer_type == "full_attention":
            specs.append(mla_spec(hf_config, dtype, block_size, scale))
        elif layer_type == "linear_attention":
            specs.append(kda_spec(hf_config, dtype, block_size))
        else:
            raise ValueError(f"layer {i} has layer type {layer_type!r}; Kimi Linear has "
                             "full_attention and linear_attention layers")
    return specs


def shrink_kda_heads(local: Any, hf_config: Any, tp: int) -> None:
    """KDA split by heads; the shared experts as DeepSeek-V3's."""
    check_shared_experts(local, hf_config, tp)
    check_divides(tp, hf_config.linear_num_heads, "the model's KDA heads")
    local.linear_num_heads = hf_config.linear_num_heads // tp


def tiny(hf_config: Any) -> Any:
    """KDA and MLA layers interleaved, one dense layer then MoE with a shared expert."""
    return shrink_config(
        hf_config, num_hidden_layers=4, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32,
        n_shared_experts=1, num_local_experts=8, n_group=1, topk_group=1,
        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, linear_num_heads=2, linear_head_dim=16,
        linear_conv_kernel_dim=4, max_position_embeddings=512,
    )


FAMILY = ModelFamily(
    name="kimi_linear",
    model_types=("kimi_linear",),
    model=KimiLinearForCausalLM,
    attention_specs=kimi_linear_specs,
    tp_shrink=shrink_kda_heads,
    moe=("moe_intermediate_size", "num_local_experts"),
    sequence_parallel=False,  # KDA is not wired for token slices
    # transformers' KimiLinearForCausalLM declares no tied weights: it keeps its own
    # lm_head whatever `tie_word_embeddings` says, and so does this
    ties_embeddings=False,
    tiny=tiny,
)
