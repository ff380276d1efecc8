"""Qwen3-Next (HF model_type "qwen3_next"): Gated DeltaNet layers interleaved with gated
full attention, a mixture of experts with a shared expert in the MLP.

What differs from the llama graph (families/llama.py; the weight loading is the base's):

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
head with its value heads, see `GatedDeltaNet`), so a rank's conv channels and recurrent
state hold its heads only; gated attention by heads like llama's; the routed experts as
FusedMoE splits them, the shared expert by its intermediate dim, reduced with them in one
all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.base import CausalLM, DecoderModel
from tokenmill.model.draft import DraftBase
from tokenmill.model.family import ModelFamily, shrink_config
from tokenmill.model.kv_scales import kv_cache_args
from tokenmill.model.layers import (
    Attention,
    BackendChoice,
    GatedMLP,
    GemmaRMSNorm,
    RotaryEmbedding,
    add_norm,
    resolve_backends,
    rotary_from_config,
)
from tokenmill.model.linear import LayerBuilder
from tokenmill.model.moe import FusedMoE, expert_param
from tokenmill.model.parallel import Pieces, Slice, check_divides
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.ops.linear_attention import GatedDeltaInputs, gated_delta_state_spec


def qwen3_next_specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    """One spec per layer: LINEAR (gated delta state) or FULL."""
    c = hf_config
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    state = gated_delta_state_spec(
        2 * key_dim + value_dim, c.linear_conv_kernel_dim, c.linear_num_value_heads,
        c.linear_key_head_dim, c.linear_value_head_dim, dtype,
        conv_parts=(key_dim, key_dim, value_dim),  # tensor parallel splits q, k, v apart
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
    """Holds the depthwise conv weight under HF's name (`conv1d.weight` [C, 1, K];
    `channels`: the rank's, whose checkpoint rows `shard_rules` names)."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype, shard_rules: dict) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype))
        self.shard_rules = shard_rules


class GatedDeltaNet(nn.Module):
    """The token mixer of a linear_attention layer; the recurrence is the backend's.

    Under tensor parallel (built at one rank's heads) a rank owns a contiguous run of key
    heads with their value heads: its rows of in_proj_qkvz and in_proj_ba (grouped per
    key head), its value heads' dt_bias and A_log, its q, k and v conv channels (three
    runs of the checkpoint's [q | k | v] channels), and out_proj's columns of its value
    heads, which all-reduces. Its recurrent state holds these heads only."""

    def __init__(
        self, hf_config: Any, spec: AttentionSpec, backend: AttentionBackend,
        build: LayerBuilder, prefix: str,
    ) -> None:
        super().__init__()
        c, dtype = hf_config, build.dtype
        self.spec, self.backend = spec, backend
        hk, hv = self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        key_dim, value_dim = hk * dk, hv * dv
        rank, t = build.tp.rank_in_group, build.tp.world_size
        per = hv // hk
        qkvz, ba = hk * (2 * dk + 2 * per * dv), hk * 2 * per
        self.in_proj_qkvz = build.column(f"{prefix}.in_proj_qkvz", c.hidden_size, qkvz, False)
        self.in_proj_ba = build.column(f"{prefix}.in_proj_ba", c.hidden_size, ba, False)
        whole_key_dim = t * key_dim  # the whole model's
        conv = Pieces((
            Slice(0, rank * key_dim, key_dim),
            Slice(0, whole_key_dim + rank * key_dim, key_dim),
            Slice(0, 2 * whole_key_dim + rank * value_dim, value_dim),
        ))
        self.conv1d = _Conv(2 * key_dim + value_dim, c.linear_conv_kernel_dim, dtype,
                            build.rules({"weight": conv}))
        self.dt_bias = nn.Parameter(torch.empty(hv, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(hv, dtype=dtype))
        heads = Slice(0, rank * hv, hv)
        self.shard_rules = build.rules({"dt_bias": heads, "A_log": heads})
        self.norm = GatedRMSNorm(dv, c.rms_norm_eps, dtype)
        self.out_proj = build.row(f"{prefix}.out_proj", value_dim, c.hidden_size, False)

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
    """Attention whose q projection also yields a per-head output gate (the q rows carry
    each head's query then its gate, so they split by head with them)."""

    def qkv_sizes(self) -> list[int]:
        return [2 * self.q_size, self.kv_size, self.kv_size]

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
        spec, scales = kv_cache_args(self, k, v)  # an FP8 cache's scales (or calibration)
        out = self.backend.forward(spec, q, k, v, kv_cache, metadata, **scales)
        out = out.reshape(-1, self.q_size)
        return self.o_proj(out * torch.sigmoid(gate.reshape(-1, self.q_size)))


class SparseMoe(nn.Module):
    """Routed experts plus a shared expert gated by sigmoid(shared_expert_gate(x)). Under
    tensor parallel the shared expert is built at this rank's intermediate slice,
    unreduced: its gated partial sum joins the routed experts' reduction
    (`FusedMoE.combine`). The gate (hidden -> 1) is replicated."""

    def __init__(self, hf_config: Any, build: LayerBuilder, prefix: str) -> None:
        super().__init__()
        c = hf_config
        self.moe = FusedMoE(
            hidden_size=c.hidden_size, intermediate_size=c.moe_intermediate_size,
            num_experts=c.num_experts, top_k=c.num_experts_per_tok, routing="softmax_topk",
            renormalize=bool(c.norm_topk_prob), activation="silu", router_bias=False,
            expert_bias=False, build=build, prefix=f"{prefix}.moe", shared_partial=True,
        )
        self.shared_expert = GatedMLP(c.hidden_size, c.shared_expert_intermediate_size, False,
                                      build, f"{prefix}.shared_expert", partial=True)
        self.shared_expert_gate = build.replicated(f"{prefix}.shared_expert_gate", c.hidden_size,
                                                   1, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # sigmoid(gate) scales each token's row: it commutes with the ranks' partial sums
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        routed, partial = self.moe.routed(x)
        return self.moe.combine(routed, partial, shared)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(
        self, hf_config: Any, index: int, spec: AttentionSpec, rotary: RotaryEmbedding,
        backend: AttentionBackend, build: LayerBuilder, prefix: str,
    ) -> None:
        super().__init__()
        c = hf_config
        hidden, eps = c.hidden_size, c.rms_norm_eps
        self.is_linear = spec.kind == AttentionKind.LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(c, spec, backend, build, f"{prefix}.linear_attn")
        else:
            self.self_attn = GatedAttention(
                hidden_size=hidden, spec=spec, rotary=rotary, backend=backend, build=build,
                prefix=f"{prefix}.self_attn", qkv_bias=False, o_bias=False, qk_norm_eps=eps,
                norm_cls=GemmaRMSNorm,
            )
        sparse = (index not in (c.mlp_only_layers or [])) and c.num_experts > 0 and (
            (index + 1) % c.decoder_sparse_step == 0
        )
        self.mlp = (SparseMoe(c, build, f"{prefix}.mlp") if sparse
                    else GatedMLP(hidden, c.intermediate_size, False, build, f"{prefix}.mlp"))
        self.input_layernorm = GemmaRMSNorm(hidden, eps, build.ops, build.dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, build.ops, build.dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        kv_cache: torch.Tensor, metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_norm(self.input_layernorm, hidden, residual)
        if self.is_linear:
            hidden = self.linear_attn(hidden, kv_cache, metadata)
        else:
            hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3NextModel(DecoderModel):
    """Embedding, decoder layers, final norm (HF's `model.` prefix)."""

    norm_cls = GemmaRMSNorm

    def setup(self, hf_config: Any, specs: list[AttentionSpec], build: LayerBuilder) -> None:
        self.rotary_emb = rotary_from_config(hf_config, build.ops)

    def make_layer(
        self, hf_config: Any, index: int, spec: AttentionSpec, backend: AttentionBackend,
        build: LayerBuilder, prefix: str,
    ) -> nn.Module:
        return Qwen3NextDecoderLayer(hf_config, index, spec, self.rotary_emb, backend, build,
                                     prefix)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next over the KV arena; see the module docstring for what differs."""

    body_cls = Qwen3NextModel

    def _mtp_weight(self, hf_name: str) -> bool:
        """Whether `hf_name` is the multi-token-prediction module's (`mtp.`): speculative
        decoding's draft (core/spec_decode/draft_models.py) loads those; the target skips
        them, as transformers does."""
        return hf_name.startswith("mtp.")

    @classmethod
    def expert_name(cls, hf_name: str) -> tuple[str, int | None] | None:
        prefix, sep, leaf = hf_name.partition(".mlp.experts.")
        return expert_param(f"{prefix}.mlp.moe", leaf) if sep else None

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        if self._mtp_weight(hf_name):
            return
        if hf_name.endswith(".mlp.gate.weight"):
            yield hf_name.replace(".mlp.gate.", ".mlp.moe.router."), None, tensor
            return
        expert = self.expert_name(hf_name)
        if expert is not None:  # per expert (or stacked): FusedMoE narrows to this rank's share
            yield *expert, tensor
            return
        yield from super()._convert(hf_name, tensor)


def shrink_delta_heads(local: Any, hf_config: Any, tp: int) -> None:
    """Gated DeltaNet heads split by key-head groups (each key head with its value heads),
    and the shared expert's intermediate size."""
    check_divides(tp, hf_config.linear_num_key_heads, "the model's Gated DeltaNet key heads")
    check_divides(tp, hf_config.shared_expert_intermediate_size,
                  "the shared expert's intermediate size")
    local.linear_num_key_heads = hf_config.linear_num_key_heads // tp
    local.linear_num_value_heads = hf_config.linear_num_value_heads // tp
    local.shared_expert_intermediate_size = hf_config.shared_expert_intermediate_size // tp


def tiny(hf_config: Any) -> Any:
    """Gated DeltaNet layers then gated full attention, MoE with a shared expert and one
    dense layer."""
    return shrink_config(
        hf_config, num_hidden_layers=4, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1],
        max_position_embeddings=512,
    )


# ---- Qwen3-Next multi-token prediction ------------------------------------------------------
class Qwen3NextMTP(DraftBase, Qwen3NextForCausalLM):
    """Qwen3-Next's first MTP module (vLLM's Qwen3NextMultiTokenPredictor): at position p,
    fc([pre_fc_norm_embedding(embed(x[p+1])), pre_fc_norm_hidden(h[p])]) -> a gated
    full-attention decoder layer -> norm; the target's embedding and LM head. Parameter
    names are the checkpoint's (`mtp.*`)."""

    def __init__(self, hf_config: Any, build: LayerBuilder, attention_backend: BackendChoice,
                 block_size: int) -> None:
        nn.Module.__init__(self)
        self._init_loading(hf_config, build)
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.attention_specs = self.specs(hf_config, build.dtype, block_size)
        self.layer_backends = resolve_backends(self.attention_specs, attention_backend)
        self.rotary_emb = rotary_from_config(hf_config, build.ops)
        self.mtp = nn.Module()
        self.mtp.fc = build.replicated("mtp.fc", 2 * hidden, hidden, False)
        self.mtp.layers = nn.ModuleList([Qwen3NextDecoderLayer(
            hf_config, 0, self.attention_specs[0], self.rotary_emb, self.layer_backends[0],
            build, "mtp.layers.0")])
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            setattr(self.mtp, name, GemmaRMSNorm(hidden, eps, build.ops, build.dtype))
        self.requires_grad_(False)

    def _mtp_weight(self, hf_name: str) -> bool:
        return False  # the draft loads exactly those

    @staticmethod
    def specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
        """The MTP layer's: the model's full-attention spec."""
        return [next(s for s in qwen3_next_specs(hf_config, dtype, block_size)
                     if s.kind == AttentionKind.FULL)]

    @staticmethod
    def weight_filter(hf_config: Any):
        return lambda name: name.startswith(("mtp.fc.", "mtp.layers.0.", "mtp.pre_fc_norm",
                                             "mtp.norm."))

    def attach(self, target: nn.Module) -> None:
        self.__dict__["target"] = target  # its embedding and LM head (not a submodule)

    def first_hidden(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        return hidden

    def forward(self, input_ids, positions, hidden, kv_caches, metadata):
        m = self.mtp
        embeds = self.target.model.embed(input_ids)
        x = m.fc(torch.cat([m.pre_fc_norm_embedding(embeds), m.pre_fc_norm_hidden(hidden)], -1))
        x, residual = m.layers[0](positions, x, None, kv_caches[0], metadata)
        out, _ = m.norm(x, residual)
        return out, out

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden).argmax(dim=-1)


FAMILY = ModelFamily(
    mtp=Qwen3NextMTP,
    name="qwen3_next",
    model_types=("qwen3_next",),
    model=Qwen3NextForCausalLM,
    attention_specs=qwen3_next_specs,
    tp_shrink=shrink_delta_heads,
    moe=("moe_intermediate_size", "num_experts"),
    sequence_parallel=False,  # Gated DeltaNet is not wired for token slices
    tiny=tiny,
)
