"""The widths of each layer's projections, read from an HF config's fields.

Field names are transformers' (its config classes normalise a checkpoint's own names, e.g.
Kimi's `num_experts` -> `num_local_experts`, `linear_attn_config` -> `linear_num_heads`).
A field a family lacks falls back to the generic one; what no field states (biases, a
gate riding with q, per-head q/k norms, norms per layer) is read from the family's own
model (`tokenmill.model.facts.LayerFacts`, one per layer). Each function returns (what it
describes, its `Linear`s, its other parameters).
"""

from __future__ import annotations

from typing import Any

from tokenmill.model.facts import LayerFacts
from tokenmill.planner.model_shape import Experts, Linear, Mixer, MixerKind, Split
from tokenmill.platforms.interfaces import AttentionSpec

C, R, N = Split.COLUMN, Split.ROW, Split.NONE


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def mixer_of(
    config: Any, kind: MixerKind, spec: AttentionSpec, facts: LayerFacts
) -> tuple[Mixer, tuple[Linear, ...], int]:
    if kind in (MixerKind.FULL, MixerKind.SLIDING):
        return _multi_head(config, kind, spec, facts)
    if kind == MixerKind.MLA:
        return _mla(config)
    if kind == MixerKind.GATED_DELTA:
        return _gated_delta(config)
    if kind == MixerKind.KDA:
        return _kda(config)
    return _mamba2(config)


def _multi_head(config: Any, kind: MixerKind, spec: AttentionSpec, facts: LayerFacts):
    hidden, heads, kv, head = config.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_size
    qkv_bias = facts.qkv_bias
    gate = facts.q_rows_per_head  # 2: the q rows carry a gate (gated attention)
    linears = (
        Linear("q_proj", hidden, heads * head * gate, C, qkv_bias),
        Linear("k_proj", hidden, kv * head, C, qkv_bias),
        Linear("v_proj", hidden, kv * head, C, qkv_bias),
        Linear("o_proj", heads * head, hidden, R, facts.o_bias),
    )
    other = (2 * head if facts.qk_norm else 0) + (heads if spec.sinks else 0)
    window = (spec.sliding_window or 0) if kind == MixerKind.SLIDING else 0
    return Mixer(kind, heads, kv, head, head, window=window, sinks=bool(spec.sinks)), linears, other


def _mla(config: Any):
    hidden, heads = config.hidden_size, config.num_attention_heads
    nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    rank, q_rank = config.kv_lora_rank, getattr(config, "q_lora_rank", None)
    if q_rank:
        q = (Linear("q_a_proj", hidden, q_rank, N), Linear("q_b_proj", q_rank, heads * (nope + rope), C))
    else:
        q = (Linear("q_proj", hidden, heads * (nope + rope), C),)
    linears = q + (
        Linear("kv_a_proj_with_mqa", hidden, rank + rope, N),
        Linear("kv_b_proj", rank, heads * (nope + v), C, latent_up=True),
        Linear("o_proj", heads * v, hidden, R),
    )
    mixer = Mixer(MixerKind.MLA, heads, 1, nope + rope, v, kv_lora_rank=rank, rope_dim=rope)
    return mixer, linears, rank + (q_rank or 0)  # the latent norms


def _gated_delta(config: Any):
    hidden, kernel = config.hidden_size, config.linear_conv_kernel_dim
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    channels = 2 * nk * dk + nv * dv  # q, k, v through the convolution
    linears = (
        Linear("in_proj_qkvz", hidden, 2 * nk * dk + 2 * nv * dv, C),
        Linear("in_proj_ba", hidden, 2 * nv, C),
        Linear("out_proj", nv * dv, hidden, R),
    )
    other = channels * kernel + 2 * nv + dv  # conv, dt_bias and A_log, the gated norm
    mixer = Mixer(MixerKind.GATED_DELTA, nv, nk, dk, dv, conv_channels=channels, conv_kernel=kernel)
    return mixer, linears, other


def _kda(config: Any):
    hidden, heads, dk = config.hidden_size, config.linear_num_heads, config.linear_head_dim
    dv = dk
    kernel = _get(config, "linear_conv_kernel_dim", "short_conv_kernel_size", default=4)
    linears = (
        Linear("q_proj", hidden, heads * dk, C),
        Linear("k_proj", hidden, heads * dk, C),
        Linear("v_proj", hidden, heads * dv, C),
        Linear("f_a_proj", hidden, dk, N),
        Linear("f_b_proj", dk, heads * dk, C),
        Linear("g_a_proj", hidden, dk, N),
        Linear("g_b_proj", dk, heads * dv, C),
        Linear("b_proj", hidden, heads, C),
        Linear("o_proj", heads * dv, hidden, R),
    )
    channels = heads * (2 * dk + dv)
    other = channels * kernel + heads * dk + heads + dv  # convs, dt_bias, A_log, o_norm
    mixer = Mixer(MixerKind.KDA, heads, heads, dk, dv, conv_channels=channels, conv_kernel=kernel)
    return mixer, linears, other


def _mamba2(config: Any):
    hidden, heads, head = config.hidden_size, config.mamba_n_heads, config.mamba_d_head
    groups, state, kernel = config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv
    inner = heads * head
    channels = inner + 2 * groups * state  # x, B, C through the convolution
    proj_bias = bool(getattr(config, "mamba_proj_bias", False))
    linears = (
        Linear("in_proj", hidden, 2 * inner + 2 * groups * state + heads, C, proj_bias),
        Linear("out_proj", inner, hidden, R, proj_bias),
    )
    conv_bias = channels if getattr(config, "mamba_conv_bias", True) else 0
    other = channels * kernel + conv_bias + 3 * heads + inner  # conv, dt_bias A_log D, norm
    mixer = Mixer(MixerKind.MAMBA2, heads, groups, state, head, conv_channels=channels,
                  conv_kernel=kernel)
    return mixer, linears, other


# -- MLP and experts -------------------------------------------------------------------


def num_experts(config: Any) -> int:
    return int(_get(config, "num_local_experts", "n_routed_experts", "num_experts", default=0))


def is_moe_layer(config: Any, index: int) -> bool:
    """Whether layer `index` routes to experts, by whichever rule the config states."""
    if num_experts(config) == 0:
        return False
    types = getattr(config, "mlp_layer_types", None)
    if types:  # Kimi Linear: "dense" / "sparse" per layer
        return types[index] == "sparse"
    first_dense = getattr(config, "first_k_dense_replace", None)
    if first_dense is not None:  # DeepSeek: dense first layers, then every moe_layer_freq
        return index >= first_dense and index % (getattr(config, "moe_layer_freq", 1) or 1) == 0
    if index in (getattr(config, "mlp_only_layers", None) or []):  # Qwen3-MoE, Qwen3-Next
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (index + 1) % step == 0


def mlp_of(
    config: Any, index: int, facts: LayerFacts
) -> tuple[tuple[Linear, ...], Experts | None, int]:
    hidden = config.hidden_size
    if not is_moe_layer(config, index):
        inter, bias = config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        return _gated_mlp(hidden, inter, bias), None, 0
    count = num_experts(config)
    inter = _get(config, "moe_intermediate_size", "intermediate_size")
    bias = facts.experts_biased  # its router and experts carry biases
    experts = Experts(count, config.num_experts_per_tok, inter, bias)
    linears = (Linear("router", hidden, count, N, bias),)
    shared = int(_get(config, "n_shared_experts", default=0)) * inter
    shared = int(_get(config, "shared_expert_intermediate_size", default=shared))
    if shared:
        linears += _gated_mlp(hidden, shared, False, prefix="shared_")
    if getattr(config, "shared_expert_intermediate_size", None):  # Qwen3-Next's gate
        linears += (Linear("shared_expert_gate", hidden, 1, N),)
    return linears, experts, 0


def _gated_mlp(hidden: int, inter: int, bias: bool, prefix: str = "") -> tuple[Linear, ...]:
    return (
        Linear(f"{prefix}gate_proj", hidden, inter, C, bias),
        Linear(f"{prefix}up_proj", hidden, inter, C, bias),
        Linear(f"{prefix}down_proj", inter, hidden, R, bias),
    )


def weight_bytes(config: Any, dtype_bytes: int) -> tuple[float, float]:
    """Bytes per parameter of (the projections, the routed experts) as the checkpoint
    stores them: fp8 (DeepSeek-V3's block-scaled e4m3: 1 byte and a float32 scale per
    128 x 128 block, for both), mxfp4 (gpt-oss: its experts at 4 bits and an 8-bit scale
    per 32 values; attention in the model dtype), else the model dtype."""
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if method == "fp8":
        return 1.0 + 4 / (128 * 128), 1.0 + 4 / (128 * 128)
    if method == "mxfp4":
        return float(dtype_bytes), 0.5 + 1 / 32
    return float(dtype_bytes), float(dtype_bytes)
