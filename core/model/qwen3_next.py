"""Qwen3-Next (HF model_type "qwen3_next"): Gated DeltaNet layers interleaved with gated
full attention, a mixture of experts with a shared expert in the MLP.

What differs from the llama graph (core/model/llama.py, whose loading it reuses):

- `layer_types` mix "linear_attention" (Gated DeltaNet, three of four by default) and
  "full_attention". A DeltaNet layer projects q, k, v, z (in_proj_qkvz, grouped per key
  head) and b, a (in_proj_ba); q, k, v go through a depthwise causal conv (SiLU) and the
  gated delta rule, run by the platform's LINEAR backend on per-sequence state in the KV
  arena (variant "gated_delta", core/ops/linear_attention.py); the output is normalised
  per head and gated by SiLU(z) (`GatedRMSNorm`), then out_proj. Decay g = -exp(A_log) *
  softplus(a + dt_bias), learning rate beta = sigmoid(b).
- full attention layers project q twice as wide: per head, the query then a gate;
  attention's output is multiplied by sigmoid(gate) before o_proj. q/k are normalised per
  head with (1 + w) norms; rotary covers `partial_rotary_factor` of each head.
- every norm but the gated one scales by (1 + weight) in float32 (Gemma's).
- the MLP is a `FusedMoE` (softmax then top-k, renormalised with `norm_topk_prob`) plus a
  shared expert scaled by sigmoid(shared_expert_gate(x)); layers in `mlp_only_layers`
  or off the `decoder_sparse_step` have a dense MLP. The checkpoint stores one tensor
  per expert, each loaded straight into its rows of the op's layout (FusedMoE skips
  another rank's experts).

Tensor parallel (core/model/parallel.py): a DeltaNet layer by key-head groups (each key
head with its value heads: `GatedDeltaNet.shard_for_tp`), so a rank's conv channels and
recurrent state hold its heads only; gated attention by heads like llama's; the routed
experts as FusedMoE splits them, the shared expert by its intermediate dim, reduced with
them in one all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import GroupCoordinator
from tokenmill.model.gemma3 import GemmaRMSNorm
from tokenmill.model.layers import (
    Attention,
    Embedding,
    GatedMLP,
    Linear,
    MergedLinear,
    RotaryEmbedding,
    rope_parameters,
)
from tokenmill.model.llama import CausalLM
from tokenmill.model.moe import FusedMoE
from tokenmill.model.parallel import Pieces, RowParallelLinear, Slice, shard_gated_mlp
from tokenmill.model.qwen3_moe import convert_expert_tensor
from tokenmill.ops import Ops
from tokenmill.ops.linear_attention import GatedDeltaInputs, gated_delta_state_spec
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)


def qwen3_next_specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    """One spec per layer: LINEAR (gated delta state) or FULL."""
    c = hf_config
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + (
        c.linear_num_value_heads * c.linear_value_head_dim
    )
    state = gated_delta_state_spec(
        conv_dim, c.linear_conv_kernel_dim, c.linear_num_value_heads, c.linear_key_head_dim,
        c.linear_value_head_dim, dtype,
    )
    specs = []
    for i, layer_type in enumerate(c.layer_types):
        if layer_type == "linear_attention":
            specs.append(AttentionSpec(
                AttentionKind.LINEAR, c.linear_num_value_heads, c.linear_num_key_heads,
                c.linear_key_head_dim, dtype, block_size, state=state,
            ))
        elif layer_type == "full_attention":
            head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            specs.append(AttentionSpec(
                AttentionKind.FULL, c.num_attention_heads, c.num_key_value_heads, head, dtype,
                block_size,
            ))
        else:
            raise ValueError(f"layer {i} has layer type {layer_type!r}; qwen3_next has "
                             "linear_attention and full_attention layers")
    return specs


class GatedRMSNorm(nn.Module):
    """weight * x / rms(x) (rounded to x's dtype), times SiLU(gate) in float32."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.to(x.dtype)
        return (out * F.silu(gate.float())).to(x.dtype)


class _Conv(nn.Module):
    """Holds the depthwise conv weight under HF's name (`conv1d.weight` [C, 1, K])."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype))


class GatedDeltaNet(nn.Module):
    """The token mixer of a linear_attention layer; the recurrence is the backend's."""

    def __init__(
        self, hf_config: Any, spec: AttentionSpec, backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        super().__init__()
        c = hf_config
        self.spec, self.backend = spec, backend
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv1d = _Conv(2 * key_dim + value_dim, c.linear_conv_kernel_dim, dtype)
        self.in_proj_qkvz = Linear(c.hidden_size, 2 * key_dim + 2 * value_dim, False, dtype)
        self.in_proj_ba = Linear(c.hidden_size, 2 * self.hv, False, dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.hv, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(self.hv, dtype=dtype))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps, dtype)
        self.out_proj = Linear(value_dim, c.hidden_size, False, dtype)

    def shard_for_tp(self, tp: GroupCoordinator) -> None:
        """Make this layer (built at one rank's heads) tensor-parallel rank
        `tp.rank_in_group`'s: it owns a contiguous run of key heads with their value
        heads, so its rows of in_proj_qkvz and in_proj_ba (grouped per key head), its
        value heads' dt_bias and A_log, its q, k and v conv channels (three runs of the
        checkpoint's [q | k | v] channels), and out_proj's columns of its value heads,
        which all-reduces. Its recurrent state holds these heads only."""
        rank, hk, hv, dk, dv = tp.rank_in_group, self.hk, self.hv, self.dk, self.dv
        per = hv // hk
        qkvz, ba = hk * (2 * dk + 2 * per * dv), hk * 2 * per
        self.in_proj_qkvz.tp_shards = {"weight": Slice(0, rank * qkvz, qkvz)}
        self.in_proj_ba.tp_shards = {"weight": Slice(0, rank * ba, ba)}
        heads = Slice(0, rank * hv, hv)
        self.tp_shards = {"dt_bias": heads, "A_log": heads}
        key_dim = tp.world_size * hk * dk  # the whole model's
        self.conv1d.tp_shards = {"weight": Pieces((
            Slice(0, rank * hk * dk, hk * dk),
            Slice(0, key_dim + rank * hk * dk, hk * dk),
            Slice(0, 2 * key_dim + rank * hv * dv, hv * dv),
        ))}
        self.out_proj = RowParallelLinear(self.out_proj.weight, None, tp)
        self.out_proj.tp_shards = {"weight": Slice(1, rank * hv * dv, hv * dv)}

    def forward(
        self, hidden: torch.Tensor, state_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        t = hidden.shape[0]
        per = self.hv // self.hk  # value heads per key head
        qkvz = self.in_proj_qkvz(hidden).view(t, self.hk, 2 * self.dk + 2 * per * self.dv)
        q, k, v, z = qkvz.split((self.dk, self.dk, per * self.dv, per * self.dv), dim=-1)
        b, a = self.in_proj_ba(hidden).view(t, self.hk, 2 * per).split((per, per), dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        inputs = GatedDeltaInputs(
            mixed_qkv=mixed,
            g=-self.A_log.float().exp() * F.softplus(a.reshape(t, self.hv).float() + self.dt_bias),
            beta=b.reshape(t, self.hv).sigmoid(),
            conv_weight=self.conv1d.weight[:, 0],
            conv_bias=None,
            num_k_heads=self.hk, head_k_dim=self.dk, num_v_heads=self.hv, head_v_dim=self.dv,
        )
        out = self.backend.forward(self.spec, inputs, state_cache, metadata)  # [T, Hv, dv]
        out = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(out.reshape(t, -1))


class GatedAttention(Attention):
    """Attention whose q projection also yields a per-head output gate."""

    def __init__(self, *, hidden_size: int, dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(hidden_size=hidden_size, dtype=dtype, **kwargs)
        self.qkv_proj = MergedLinear(
            hidden_size, [2 * self.q_size, self.kv_size, self.kv_size], False, dtype
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qg, k, v = self.qkv_proj(hidden).split([2 * self.q_size, self.kv_size, self.kv_size], -1)
        q, gate = qg.view(-1, self.num_heads, 2 * self.head_size).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_size))
        v = v.reshape(-1, self.num_kv_heads, self.head_size)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(self.spec, q, k, v, kv_cache, metadata).reshape(-1, self.q_size)
        return self.o_proj(out * torch.sigmoid(gate.reshape(-1, self.q_size)))


class SparseMoe(nn.Module):
    """Routed experts plus a shared expert gated by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hf_config: Any, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        c = hf_config
        self.moe = FusedMoE(
            hidden_size=c.hidden_size, intermediate_size=c.moe_intermediate_size,
            num_experts=c.num_experts, top_k=c.num_experts_per_tok, routing="softmax_topk",
            renormalize=bool(c.norm_topk_prob), activation="silu", router_bias=False,
            expert_bias=False, ops=ops, dtype=dtype,
        )
        self.shared_expert = GatedMLP(c.hidden_size, c.shared_expert_intermediate_size, False,
                                      ops, dtype)
        self.shared_expert_gate = Linear(c.hidden_size, 1, False, dtype)

    def shard_for_tp(self, tp: GroupCoordinator) -> None:
        """The shared expert (built at this rank's intermediate slice) split like a dense
        MLP, unreduced: its gated partial sum joins the routed experts' reduction
        (`FusedMoE.combine`). The gate (hidden -> 1) is replicated."""
        shard_gated_mlp(self.shared_expert, tp, reduce=False)
        self.moe.__dict__["shared_tp"] = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # sigmoid(gate) scales each token's row: it commutes with the ranks' partial sums
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        routed, partial = self.moe.routed(x)
        return self.moe.combine(routed, partial, shared)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(
        self, hf_config: Any, index: int, spec: AttentionSpec, rotary: RotaryEmbedding,
        backend: AttentionBackend, ops: Ops, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        c = hf_config
        hidden, eps = c.hidden_size, c.rms_norm_eps
        self.is_linear = spec.kind == AttentionKind.LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(c, spec, backend, dtype)
        else:
            self.self_attn = GatedAttention(
                hidden_size=hidden, spec=spec, rotary=rotary, backend=backend, ops=ops,
                dtype=dtype, qkv_bias=False, o_bias=False, qk_norm_eps=eps,
                norm_cls=GemmaRMSNorm,
            )
        sparse = (index not in (c.mlp_only_layers or [])) and c.num_experts > 0 and (
            (index + 1) % c.decoder_sparse_step == 0
        )
        self.mlp = (SparseMoe(c, ops, dtype) if sparse
                    else GatedMLP(hidden, c.intermediate_size, False, ops, dtype))
        self.input_layernorm = GemmaRMSNorm(hidden, eps, ops, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, ops, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        kv_cache: torch.Tensor, metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            hidden = self.linear_attn(hidden, kv_cache, metadata)
        else:
            hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3NextModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(
        self, hf_config: Any, specs: list[AttentionSpec], backends: list[AttentionBackend],
        ops: Ops, dtype: torch.dtype, first_layer: int = 0,
    ) -> None:
        super().__init__()
        c = hf_config
        # from the config: a pipeline stage may hold no attention layer
        head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        params = rope_parameters(c)
        rotary_dim = int(head * params.get("partial_rotary_factor", 1.0))
        self.rotary_emb = RotaryEmbedding(params, rotary_dim, c.max_position_embeddings, ops)
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(c, i, spec, self.rotary_emb, backend, ops, dtype)
            for i, spec, backend in zip(range(first_layer, first_layer + len(specs)), specs,
                                        backends, strict=True)
        )
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, ops, dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        metadata: list[AttentionMetadata],
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metadata, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next over the KV arena; see the module docstring for what differs."""

    @classmethod
    def attention_specs_for(
        cls, hf_config: Any, dtype: torch.dtype, block_size: int
    ) -> list[AttentionSpec]:
        return qwen3_next_specs(hf_config, dtype, block_size)

    def _build_model(
        self, hf_config: Any, specs: list[AttentionSpec], backends: list[AttentionBackend],
        ops: Ops, dtype: torch.dtype,
    ) -> nn.Module:
        return Qwen3NextModel(hf_config, specs, backends, ops, dtype, self.first_layer)

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        if hf_name.endswith(".mlp.gate.weight"):
            yield hf_name.replace(".mlp.gate.", ".mlp.moe.router."), None, tensor
            return
        prefix, sep, leaf = hf_name.partition(".mlp.experts.")
        if sep:  # per expert (or stacked): FusedMoE narrows to this rank's share
            converted = list(convert_expert_tensor(f"{prefix}.mlp.moe", leaf, tensor))
            if converted:
                yield from converted
                return
        yield from super()._convert(hf_name, tensor)
