"""A model's shape for the performance model, read from its HF config without weights.

Per layer: its token mixer (the attention kind the family declares for it, with its widths),
its projections (each a `Linear` that tensor parallelism splits by columns, by rows, or not
at all) and its MLP or routed experts. The kind of every layer and its KV or state bytes
come from the family's own attention specs (`tokenmill.model.registry.attention_specs_for`:
what the engine's KV arena sizes), the widths from the config's fields through
transformers' config classes. Parameter counts equal transformers' models built from the
same config (tests/planner/test_model_shape.py checks it for every family).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec


class Split(str, enum.Enum):
    """How tensor parallelism splits a projection over its t ranks."""

    COLUMN = "column"  # output features split: each rank computes out / t
    ROW = "row"  # input features split: partial outputs all-reduced
    NONE = "none"  # replicated: every rank computes all of it


class MixerKind(str, enum.Enum):
    FULL = "full"
    SLIDING = "sliding"
    MLA = "mla"
    GATED_DELTA = "gated_delta"
    KDA = "kda"
    MAMBA2 = "mamba2"

    @property
    def recurrent(self) -> bool:
        return self in (MixerKind.GATED_DELTA, MixerKind.KDA, MixerKind.MAMBA2)


@dataclass(frozen=True, slots=True)
class Linear:
    """One weight matrix applied to every token (`latent_up`: MLA's kv_b, applied to the
    cached latents in prefill and absorbed into the query and output in decode)."""

    name: str
    in_features: int
    out_features: int
    split: Split
    bias: bool = False
    latent_up: bool = False

    @property
    def num_params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True, slots=True)
class Mixer:
    """A layer's token mixer. Attention: `num_heads` query heads of `qk_dim` (MLA: nope +
    rope) and `v_dim`, `num_kv_heads` KV heads (MLA: one latent row of `kv_lora_rank` +
    `rope_dim`). Recurrent kinds: `num_heads` value heads, `num_kv_heads` key heads (B/C
    groups for Mamba2), a state of `qk_dim` x `v_dim` per head (Mamba2: d_state x head
    dim), a short convolution over `conv_channels` of width `conv_kernel`."""

    kind: MixerKind
    num_heads: int
    num_kv_heads: int
    qk_dim: int
    v_dim: int
    window: int = 0
    sinks: bool = False
    kv_lora_rank: int = 0
    rope_dim: int = 0
    conv_channels: int = 0
    conv_kernel: int = 0


@dataclass(frozen=True, slots=True)
class Experts:
    """Routed experts (gated: gate and up of `intermediate`, then down), `top_k` per token."""

    num_experts: int
    top_k: int
    intermediate: int
    bias: bool = False


@dataclass(frozen=True, slots=True)
class Layer:
    mixer: Mixer
    linears: tuple[Linear, ...]  # the mixer's projections, then the MLP's / shared experts'
    experts: Experts | None
    spec: AttentionSpec  # the family's spec of this layer: what the KV arena holds for it
    other_params: int  # norms, convolutions, per-head scalars: parameters of no GEMM
    norms: int = 2  # hidden-sized norms (before and after attention; Gemma 3 has four)


@dataclass(frozen=True, slots=True, eq=False)
class ModelShape:
    """Compared and hashed by identity: one shape per model read (the step costs cache by it)."""

    name: str
    model_type: str
    hidden: int
    vocab: int
    layers: tuple[Layer, ...]
    tied: bool  # the LM head is the embedding
    linear_bytes: float  # bytes per parameter of the projections as stored (fp8: ~1)
    expert_bytes: float  # bytes per parameter of the routed experts (mxfp4: ~0.53)
    dtype_bytes: int  # activations, KV cache, norms, embedding, LM head, routers
    hf_config: Any

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_params(self) -> int:
        """Every parameter, as transformers' model of this config has them."""
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + head + self.hidden + sum(
            layer_params(layer, self.hidden) for layer in self.layers)

    @property
    def active_params(self) -> int:
        """Parameters one token's forward reads (routed experts: `top_k` of them)."""
        head = self.vocab * self.hidden  # the LM head (the embedding lookup reads one row)
        total = head + self.hidden
        for layer in self.layers:
            total += layer_params(layer, self.hidden, active=True)
        return total


def expert_params(experts: Experts, hidden: int) -> int:
    """One expert's parameters: gate and up [hidden -> intermediate] and down back."""
    bias = 2 * experts.intermediate + hidden if experts.bias else 0
    return 3 * hidden * experts.intermediate + bias


def layer_params(layer: Layer, hidden: int, active: bool = False) -> int:
    total = layer.other_params + sum(lin.num_params for lin in layer.linears)
    if layer.experts is not None:
        count = layer.experts.top_k if active else layer.experts.num_experts
        total += count * expert_params(layer.experts, hidden)
    return total


# -- reading a config ------------------------------------------------------------------


def mixer_kind(spec: AttentionSpec) -> MixerKind:
    if spec.kind == AttentionKind.LINEAR:
        assert spec.state is not None
        return MixerKind(spec.state.variant)
    return {
        AttentionKind.FULL: MixerKind.FULL,
        AttentionKind.SLIDING_WINDOW: MixerKind.SLIDING,
        AttentionKind.MLA: MixerKind.MLA,
    }[spec.kind]


def shape_from_config(
    hf_config: Any, specs: list[AttentionSpec], name: str, dtype_bytes: int,
    weight_bytes: float | None = None, tied: bool | None = None,
) -> ModelShape:
    """The `ModelShape` of `hf_config`, whose layers the family declares as `specs`.
    `weight_bytes`: bytes per projection and expert parameter (None: as the checkpoint's
    quantization stores them). `tied`: whether the LM head is the embedding (None: as the
    config says)."""
    from tokenmill.model.facts import layer_facts
    from tokenmill.planner import config_fields as fields

    hidden = hf_config.hidden_size
    layers = []
    for index, (spec, facts) in enumerate(zip(specs, layer_facts(hf_config), strict=True)):
        kind = mixer_kind(spec)
        mixer, linears, other = fields.mixer_of(hf_config, kind, spec, facts)
        mlp, experts, mlp_other = fields.mlp_of(hf_config, index, facts)
        norms = facts.norms * hidden
        layers.append(Layer(mixer, linears + mlp, experts, spec, other + mlp_other + norms,
                            facts.norms))
    linear_bytes, expert_bytes = fields.weight_bytes(hf_config, dtype_bytes)
    if weight_bytes is not None:
        linear_bytes = expert_bytes = weight_bytes
    return ModelShape(
        name=name,
        model_type=hf_config.model_type,
        hidden=hidden,
        vocab=hf_config.vocab_size,
        layers=tuple(layers),
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)) if tied is None else tied,
        linear_bytes=linear_bytes,
        expert_bytes=expert_bytes,
        dtype_bytes=dtype_bytes,
        hf_config=hf_config,
    )


def weight_bytes_of(linear: Linear, model: ModelShape) -> float:
    """Bytes one copy of `linear`'s weight takes (routers stay in the model dtype)."""
    per = model.dtype_bytes if linear.name in ROUTERS else model.linear_bytes
    return linear.num_params * per


def weights_bytes(model: ModelShape) -> float:
    """Bytes of every weight of the model, as stored."""
    total = (model.num_params - sum(
        layer_params(layer, model.hidden) for layer in model.layers)) * model.dtype_bytes
    for layer in model.layers:
        total += layer.other_params * model.dtype_bytes
        total += sum(weight_bytes_of(lin, model) for lin in layer.linears)
        if layer.experts is not None:
            total += layer.experts.num_experts * expert_params(layer.experts, model.hidden) * (
                model.expert_bytes)
    return total


ROUTERS = ("router", "shared_expert_gate")
