"""The JAX model graph: llama, qwen2, qwen3 and Gemma 3 (text) decoders over paged KV.

One jitted function runs a whole engine step (`forward`): embed, the decoder layers as a
`lax.scan` over weights stacked by layer (one compiled layer body however deep the
model), the final norm on the rows that sample, the logits. Each layer writes its keys and
values into the KV arena's pages (a JAX array over the worker's arena, in the contract's
layout) and attends through the Pallas kernel (`tokenmill_tpu.kernels`); the layer's arena
slot, KV group (its block table), sliding window and rotary table are scanned values, so
Gemma 3's interleaved sliding and global layers share the one body. The step returns the
keys and values it wrote, which the runner copies into the arena itself.

| model_type  | q/k/v bias     | q/k norm      | norms         | MLP act  | embed scale | attention scale          |
|-------------|----------------|---------------|---------------|----------|-------------|--------------------------|
| llama       | attention_bias | no            | x * w         | silu     | 1           | head_dim ** -0.5         |
| qwen2       | q/k/v always   | no            | x * w         | silu     | 1           | head_dim ** -0.5         |
| qwen3       | attention_bias | x * w         | x * w         | silu     | 1           | head_dim ** -0.5         |
| gemma3_text | attention_bias | x * (1 + w)   | x * (1 + w), sandwich | gelu_tanh | sqrt(hidden) | query_pre_attn_scalar ** -0.5 |

Norms and softmax compute in float32, as the core's reference ops and transformers do.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from tokenmill_tpu.attention import gather_tiles
from tokenmill_tpu.kernels import ragged_paged_attention, write_kv

SUPPORTED_MODEL_TYPES = ("gemma3_text", "llama", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The static shape and switches of one model (hashable: a jit static argument)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float
    attention_scale: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    gemma: bool  # (1 + w) norms, sandwich norms, gelu, scaled embedding
    tie_word_embeddings: bool
    final_logit_softcap: float | None
    windows: tuple[int, ...]  # per layer; 0 = full attention
    rope_tables: tuple[int, ...]  # per layer: which rotary table (0 full, 1 sliding)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size


def model_config(hf_config: Any) -> ModelConfig:
    """Our static config from an HF config; ValueError naming an unsupported model type."""
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the tpu runner; supported: "
            f"{list(SUPPORTED_MODEL_TYPES)}"
        )
    num_heads = hf_config.num_attention_heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    num_layers = hf_config.num_hidden_layers
    layer_types = getattr(hf_config, "layer_types", None) or ["full_attention"] * num_layers
    window = getattr(hf_config, "sliding_window", None) or 0
    sliding = [t == "sliding_attention" and window > 0 for t in layer_types]
    gemma = model_type == "gemma3_text"
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    scale = (hf_config.query_pre_attn_scalar if gemma else head_size) ** -0.5
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_size=head_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        attention_scale=float(scale),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        gemma=gemma,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
        windows=tuple(window if s else 0 for s in sliding),
        rope_tables=tuple(1 if s and gemma else 0 for s in sliding),
    )


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, gemma: bool) -> jax.Array:
    """float32 RMS norm; llama scales after casting back (w * x), Gemma before (x * (1 + w))."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def rotary(x: jax.Array, cos_sin: jax.Array) -> jax.Array:
    """Neox rotary on the first rotary_dim channels; cos_sin float32 [T, rotary_dim]."""
    rotary_dim = cos_sin.shape[-1]
    half = rotary_dim // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:rotary_dim].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return jnp.concatenate([out, x[..., rotary_dim:]], axis=-1) if rotary_dim < x.shape[-1] else out


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    y = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    return y if b is None else y + b


@dataclass(frozen=True, slots=True)
class StepShape:
    """The static parts of a step's inputs besides the model (jit static argument)."""

    tile_size: int
    interpret: bool


def _layer(cfg: ModelConfig, shape: StepShape, batch: dict, carry, layer):
    hidden, kv = carry
    w, slot, group, window, table = layer
    T = hidden.shape[0]
    h = rms_norm(hidden, w["input_norm"], cfg.rms_norm_eps, cfg.gemma)
    q = _linear(h, w["q"], w.get("q_bias")).reshape(T, cfg.num_heads, cfg.head_size)
    k = _linear(h, w["k"], w.get("k_bias")).reshape(T, cfg.num_kv_heads, cfg.head_size)
    v = _linear(h, w["v"], w.get("v_bias")).reshape(T, cfg.num_kv_heads, cfg.head_size)
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps, cfg.gemma)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps, cfg.gemma)
    cos_sin = batch["rope"][table][batch["positions"]]
    q, k = rotary(q, cos_sin), rotary(k, cos_sin)
    kv = write_kv(kv, slot, k, v, batch["slots"][group])
    out = ragged_paged_attention(
        gather_tiles(q, batch["tile_token"], shape.tile_size), kv, slot[None], window[None],
        batch["tile_seq"], batch["tile_pos"], batch["tile_len"], batch["seq_lens"],
        batch["block_tables"][group], scale=cfg.attention_scale, interpret=shape.interpret,
    )
    attn = out[batch["token_tile"], batch["token_row"]].reshape(T, cfg.q_size)
    attn = _linear(attn, w["o"], w.get("o_bias"))
    if cfg.gemma:
        hidden = hidden + rms_norm(attn, w["post_attn_norm"], cfg.rms_norm_eps, True)
        h = rms_norm(hidden, w["pre_ff_norm"], cfg.rms_norm_eps, True)
    else:
        hidden = hidden + attn
        h = rms_norm(hidden, w["post_attn_norm"], cfg.rms_norm_eps, False)
    gate = _linear(h, w["gate"], w.get("gate_bias"))
    up = _linear(h, w["up"], w.get("up_bias"))
    act = jax.nn.gelu(gate, approximate=True) if cfg.gemma else jax.nn.silu(gate)
    mlp = _linear(act * up, w["down"], w.get("down_bias"))
    if cfg.gemma:
        mlp = rms_norm(mlp, w["post_ff_norm"], cfg.rms_norm_eps, True)
    return (hidden + mlp, kv), (k.astype(kv.dtype), v.astype(kv.dtype))


@partial(jax.jit, static_argnames=("cfg", "shape"))
def forward(params: dict, kv: jax.Array, batch: dict, *, cfg: ModelConfig, shape: StepShape):
    """One engine step: (float32 logits [num_sample_rows, vocab], the keys and values it
    wrote [num_layers, T, kv_heads, head_size] each).

    `kv` is the arena [num_slots, 2, num_blocks, block_size, kv_heads, head_size] (read,
    never modified: the caller writes the returned keys and values into its pages).
    `batch` holds the step's padded int32 arrays: input_ids, positions, slots [groups, T]
    (per KV group; padding tokens point past the cache and write nothing), the query-tile
    plan, seq_lens, block_tables [groups, num_seqs, pages], sample_rows (the token index
    of each row that samples), the per-layer arena slot `layer_slots` and KV group
    `layer_groups`, and the rotary tables `rope` [2, max_position, rotary_dim].
    """
    embed = params["embed"]
    hidden = embed[batch["input_ids"]]
    if cfg.gemma:
        hidden = hidden * jnp.asarray(cfg.hidden_size**0.5, hidden.dtype)
    layers = (
        params["layers"],
        batch["layer_slots"],
        batch["layer_groups"],
        jnp.asarray(cfg.windows, jnp.int32),
        jnp.asarray(cfg.rope_tables, jnp.int32),
    )
    (hidden, _), (keys, values) = jax.lax.scan(
        partial(_layer, cfg, shape, batch), (hidden, kv), layers
    )
    rows = rms_norm(hidden[batch["sample_rows"]], params["final_norm"], cfg.rms_norm_eps, cfg.gemma)
    head = embed.T if cfg.tie_word_embeddings else params["lm_head"]
    logits = jnp.dot(rows, head, precision=jax.lax.Precision.HIGHEST).astype(jnp.float32)
    if cfg.final_logit_softcap:
        logits = jnp.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
    return logits, keys, values
