"""Bamba (HF model_type "bamba") in JAX: a hybrid of Mamba2 mixers and full attention.

Most layers are Mamba2 mixers (an AttentionKind.LINEAR layer: a recurrent state per
sequence, kept in the worker's KV arena pages), the layers in `attn_layer_indices` full
attention with half-rotary heads and no q/k norm; every layer has a SwiGLU MLP
(`feed_forward`). The layers differ, so the step unrolls them (no `lax.scan`).

The mixer over a step's ragged batch: the tokens are laid out per sequence, padded to the
step's longest run ([S, L]); per sequence, a causal depthwise convolution over the K - 1
inputs before the step and the new ones, then the recurrence token by token
(`lax.scan`): S <- exp(dt A) S + dt x B^T, y = S C + D x, with
dt = clamp(softplus(dt_raw + dt_bias), dt_limit); padding tokens get dt = 0 and x = 0,
which leave the state as it is. The states after chosen token counts come out too
(prefix-cache checkpoints). The math is the core's reference
(`tokenmill.platforms.ops.mamba2`), which transformers' Bamba torch path equals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from tokenmill.platforms.ops.rotary import rope_parameters


@dataclass(frozen=True, slots=True)
class BambaConfig:
    """Bamba's static shapes (hashable: a jit static argument)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_is_mamba: tuple[bool, ...]
    num_heads: int
    num_kv_heads: int
    head_size: int
    rotary_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    mamba_heads: int
    mamba_head_dim: int
    mamba_groups: int
    mamba_state: int
    conv_kernel: int
    dt_limit: tuple[float, float]

    @property
    def num_layers(self) -> int:
        return len(self.layer_is_mamba)

    @property
    def mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_inner + 2 * self.mamba_groups * self.mamba_state


def bamba_config(hf_config: Any) -> BambaConfig:
    num_heads = hf_config.num_attention_heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    limit = getattr(hf_config, "time_step_limit", None) or (0.0, float("inf"))
    factor = rope_parameters(hf_config).get("partial_rotary_factor", 1.0)
    return BambaConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        layer_is_mamba=tuple(t != "full_attention" for t in hf_config.layers_block_type),
        num_heads=num_heads,
        num_kv_heads=hf_config.num_key_value_heads or num_heads,
        head_size=head_size,
        rotary_dim=int(head_size * factor),
        rms_norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        mamba_heads=hf_config.mamba_n_heads,
        mamba_head_dim=hf_config.mamba_d_head,
        mamba_groups=hf_config.mamba_n_groups,
        mamba_state=hf_config.mamba_d_state,
        conv_kernel=hf_config.mamba_d_conv,
        dt_limit=(float(limit[0]), float(limit[1])),
    )


def _mixer_one(w: dict, cfg: BambaConfig, xbc, dt, n, conv0, ssm0, marks):
    """One sequence: xbc [L, C], dt [L, H] (raw), n real tokens, conv0 [C, K - 1],
    ssm0 [H, P, N] float32, marks [M] token counts (-1: none). Returns (y [L, H * P],
    conv state, ssm state, conv states at marks [M, C, K - 1], ssm states at marks)."""
    k, length = cfg.conv_kernel, xbc.shape[0]
    hist = jnp.concatenate([conv0.T.astype(xbc.dtype), xbc])  # [K - 1 + L, C]
    conv = sum(hist[i : i + length].astype(jnp.float32) * w["conv_w"][:, i] for i in range(k))
    conv = jax.nn.silu(conv + w["conv_b"]).astype(xbc.dtype)
    inner, bc = cfg.mamba_inner, cfg.mamba_groups * cfg.mamba_state
    valid = jnp.arange(length) < n
    x = jnp.where(valid[:, None], conv[:, :inner], 0).astype(jnp.float32)
    x = x.reshape(length, cfg.mamba_heads, cfg.mamba_head_dim)
    per_group = cfg.mamba_heads // cfg.mamba_groups
    B = conv[:, inner : inner + bc].astype(jnp.float32).reshape(length, cfg.mamba_groups, -1)
    C = conv[:, inner + bc :].astype(jnp.float32).reshape(length, cfg.mamba_groups, -1)
    B, C = jnp.repeat(B, per_group, axis=1), jnp.repeat(C, per_group, axis=1)  # [L, H, N]
    step = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + w["dt_bias"]), *cfg.dt_limit)
    step = jnp.where(valid[:, None], step, 0.0)
    marks_ssm0 = jnp.zeros((marks.shape[0], *ssm0.shape), jnp.float32)

    def token(carry, inputs):
        state, saved = carry
        t, xt, bt, ct, dtt = inputs
        state = (jnp.exp(dtt * w["A"])[:, None, None] * state
                 + (dtt[:, None] * xt)[:, :, None] * bt[:, None, :])
        y = jnp.einsum("hpn,hn->hp", state, ct) + w["D"][:, None] * xt
        saved = jnp.where((marks == t + 1)[:, None, None, None], state[None], saved)
        return (state, saved), y

    (ssm, ssm_marks), y = jax.lax.scan(
        token, (ssm0.astype(jnp.float32), marks_ssm0),
        (jnp.arange(length), x, B, C, step),
    )
    conv_state = jax.lax.dynamic_slice_in_dim(hist, n, k - 1).T
    conv_marks = jax.vmap(lambda m: jax.lax.dynamic_slice_in_dim(hist, jnp.maximum(m, 0), k - 1).T)(marks)
    return y.reshape(length, -1).astype(xbc.dtype), conv_state, ssm, conv_marks, ssm_marks


def mamba2_mixer(w: dict, cfg: BambaConfig, xbc, dt, lens, conv0, ssm0, marks):
    """The mixer's convolution and scan over S sequences padded to L tokens (see
    `_mixer_one`, batched)."""
    one = jax.vmap(lambda *a: _mixer_one(w, cfg, *a))
    return one(xbc, dt, lens, conv0, ssm0, marks)


def gated_rms_norm(y, gate, weight, eps: float, groups: int):
    """weight * rms_norm(y * silu(gate)) over `groups` groups of channels, float32 math."""
    h = y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    g = h.reshape(*h.shape[:-1], groups, -1)
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    return weight * g.reshape(h.shape).astype(y.dtype)
