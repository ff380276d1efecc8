"""Kimi Linear (HF model_type "kimi_linear"): Kimi Delta Attention layers and MLA layers,
DeepSeek-V3's MoE.

- `layer_types[i]` "linear_attention": a KDA layer (kind LINEAR, variant "kda" of the
  platform's linear-attention backend; reference `tokenmill.ops.linear_attention`): q, k,
  v projections (fused), a depthwise causal conv with SiLU, a per-channel forget gate
  g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), beta = sigmoid(b_proj(x)), the
  per-channel gated delta rule over a recurrent state kept in the KV arena (checkpoints
  store q, k, v convs separately: `q_conv1d`...), then a gated RMS norm (weight, times sigmoid(g_b(g_a(x)))) per head and o_proj;
- "full_attention": MLA (core/model/mla.py) with no rotary (NoPE), softmax scale
  qk_head_dim ** -0.5;
- `mlp_layer_types[i]` "dense" (gated MLP) or "sparse" (`deepseek_v3.make_moe`: sigmoid
  group-limited routing with the correction bias, shared experts).

Tensor parallel: KDA by heads (`KimiDeltaAttention.shard_for_tp`), MLA and the MoE as
DeepSeek-V3's (core/model/deepseek_v3.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.distributed.parallel_state import GroupCoordinator
from tokenmill.model.deepseek_v3 import DeepseekV3ForCausalLM, MLADecoderLayer
from tokenmill.model.layers import Embedding, Linear, MergedLinear, RMSNorm
from tokenmill.model.mla import MLAAttention, mla_spec
from tokenmill.model.parallel import RowParallelLinear, Slice
from tokenmill.ops import Ops
from tokenmill.ops.linear_attention import KDAInputs, kda_state_spec
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)

_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def kda_spec(hf_config: Any, dtype: torch.dtype, block_size: int) -> AttentionSpec:
    heads, dim = hf_config.linear_num_heads, hf_config.linear_head_dim
    return AttentionSpec(
        kind=AttentionKind.LINEAR, num_heads=heads, num_kv_heads=heads, head_size=dim,
        dtype=dtype, block_size=block_size,
        state=kda_state_spec(heads, dim, hf_config.linear_conv_kernel_dim, dtype),
    )


class _Conv(nn.Module):
    """Holds a depthwise conv's weight [C, 1, K] under HF's name `<x>_conv1d.weight`."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype))


class KimiDeltaAttention(nn.Module):
    """A KDA layer over the platform's linear-attention backend (see the module doc)."""

    def __init__(self, hf_config: Any, spec: AttentionSpec, backend: AttentionBackend,
                 dtype: torch.dtype) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        heads, dim = hf_config.linear_num_heads, hf_config.linear_head_dim
        size = heads * dim
        self.spec, self.heads, self.dim = spec, heads, dim
        self.eps = hf_config.rms_norm_eps
        self.qkv_proj = MergedLinear(hidden, [size, size, size], False, dtype)
        kernel = hf_config.linear_conv_kernel_dim
        self.q_conv1d = _Conv(size, kernel, dtype)
        self.k_conv1d = _Conv(size, kernel, dtype)
        self.v_conv1d = _Conv(size, kernel, dtype)
        # the forget gate: g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) per channel
        self.f_a_proj = Linear(hidden, dim, False, dtype)
        self.f_b_proj = Linear(dim, size, False, dtype)
        self.dt_bias = nn.Parameter(torch.empty(size, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(1, 1, heads, 1, dtype=torch.float32))
        self.b_proj = Linear(hidden, heads, False, dtype)
        self.g_a_proj = Linear(hidden, dim, False, dtype)
        self.g_b_proj = Linear(dim, size, False, dtype)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.o_proj = Linear(size, hidden, False, dtype)
        self.backend = backend

    def shard_for_tp(self, tp: GroupCoordinator) -> None:
        """Make this layer (built at one rank's heads) tensor-parallel rank
        `tp.rank_in_group`'s: each head's channels are contiguous in every per-channel
        tensor, so the rank keeps its heads' rows of q, k, v, f_b, g_b and b_proj, its
        channels of the three convs and dt_bias, its heads of A_log, and o_proj's
        columns, which all-reduces. The low-rank f_a / g_a and the per-head o_norm are
        replicated; the recurrent state holds this rank's heads only."""
        rank, size = tp.rank_in_group, self.heads * self.dim
        channels = Slice(0, rank * size, size)
        self.qkv_proj.tp_shards = {"weight": [channels] * 3}
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.tp_shards = {"weight": channels}
        self.f_b_proj.tp_shards = self.g_b_proj.tp_shards = {"weight": channels}
        self.b_proj.tp_shards = {"weight": Slice(0, rank * self.heads, self.heads)}
        self.tp_shards = {"dt_bias": channels, "A_log": Slice(2, rank * self.heads, self.heads)}
        self.o_proj = RowParallelLinear(self.o_proj.weight, None, tp)
        self.o_proj.tp_shards = {"weight": Slice(1, rank * size, size)}

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


class KimiLinearModel(nn.Module):
    """Embedding, KDA and MLA decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(self, hf_config: Any, specs: list[AttentionSpec],
                 backends: list[AttentionBackend], ops: Ops, dtype: torch.dtype,
                 first_layer: int = 0) -> None:
        super().__init__()
        self.embed_tokens = Embedding(hf_config.vocab_size, hf_config.hidden_size, dtype)
        layers = []
        for i, spec, backend in zip(range(first_layer, first_layer + len(specs)), specs,
                                    backends, strict=True):
            if spec.kind == AttentionKind.MLA:
                attention = MLAAttention(hf_config=hf_config, spec=spec, rotary=None,
                                         rope_interleave=False, backend=backend, ops=ops,
                                         dtype=dtype)
            else:
                attention = KimiDeltaAttention(hf_config, spec, backend, dtype)
            moe = hf_config.mlp_layer_types[i] == "sparse"
            layers.append(MLADecoderLayer(hf_config, attention, moe, ops, dtype))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, ops, dtype)

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metadata, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    """Kimi Linear over the KV arena (latent pages for MLA, state slots for KDA)."""

    # transformers' KimiLinearForCausalLM declares no tied weights: it keeps its own
    # lm_head whatever `tie_word_embeddings` says, and so does this
    ties_embeddings = False

    @classmethod
    def attention_specs_for(
        cls, hf_config: Any, dtype: torch.dtype, block_size: int
    ) -> list[AttentionSpec]:
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

    def _build_model(self, hf_config, specs, backends, ops, dtype) -> nn.Module:
        return KimiLinearModel(hf_config, specs, backends, ops, dtype, self.first_layer)

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
