"""The tpu runner for a hybrid model (Bamba: Mamba2 mixers and full attention).

Same seam as `TpuModelRunner` (whose inputs, sampling and KV write-back it reuses): the
attention layers' keys and values live in the worker's arena pages, and so do the Mamba2
layers' recurrent states, packed over their state slots' pages in the contract's layout
(`tokenmill.platforms.kit.kv_state`). Each step the runner reads every scheduled
sequence's states on the host (its slot, a prefix-cache checkpoint the step restores, or
zeros at token 0), runs the jitted step (`forward_bamba`), and writes the new states to
the slots and the checkpoints the step asks for (`StepDescription.recurrent_state`), so
prefix caching and KV offload see the states as they see the core's runner's.

One JAX device (no tensor parallel for the hybrid yet).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tokenmill.platforms.interfaces import (
    AttentionKind,
    ModelRunnerContext,
    RunnerCapabilities,
)
from tokenmill.platforms.kit.kv_state import read_states, write_states, zero_states
from tokenmill.platforms.kit.runner_state import ScheduledRow
from tokenmill.platforms.ops.rotary import build_cos_sin_cache, rope_parameters
from tokenmill.platforms.step import RecurrentStateOps
from tokenmill_tpu.attention import gather_tiles
from tokenmill_tpu.bamba import BambaConfig, bamba_config, gated_rms_norm, mamba2_mixer
from tokenmill_tpu.buckets import bucket
from tokenmill_tpu.convert import numpy_dtype, to_numpy, to_torch
from tokenmill_tpu.kernels import ragged_paged_attention, write_kv
from tokenmill_tpu.model import StepShape, rms_norm, rotary
from tokenmill_tpu.runner import TpuModelRunner

_NAMES = {  # HF name inside a layer -> (ours, transpose)
    "input_layernorm.weight": ("input_norm", False),
    "pre_ff_layernorm.weight": ("pre_ff_norm", False),
    "feed_forward.gate_proj.weight": ("gate", True),
    "feed_forward.up_proj.weight": ("up", True),
    "feed_forward.down_proj.weight": ("down", True),
    "self_attn.q_proj.weight": ("q", True),
    "self_attn.k_proj.weight": ("k", True),
    "self_attn.v_proj.weight": ("v", True),
    "self_attn.o_proj.weight": ("o", True),
    "mamba.in_proj.weight": ("in_proj", True),
    "mamba.conv1d.weight": ("conv_w", False),
    "mamba.conv1d.bias": ("conv_b", False),
    "mamba.dt_bias": ("dt_bias", False),
    "mamba.A_log": ("A_log", False),
    "mamba.D": ("D", False),
    "mamba.norm.weight": ("norm", False),
    "mamba.out_proj.weight": ("out_proj", True),
}
_FLOAT32 = {"conv_w", "conv_b", "dt_bias", "A_log", "D"}  # the scan's math is float32


def convert_bamba_weights(cfg: BambaConfig, weights, dtype: torch.dtype) -> dict[str, Any]:
    """numpy params {embed, final_norm, [lm_head], layers: [per layer {name: array}]}.
    Raises KeyError naming an unknown or missing weight."""
    target = numpy_dtype(dtype)
    top: dict[str, np.ndarray] = {}
    layers: list[dict[str, np.ndarray]] = [{} for _ in range(cfg.num_layers)]
    for name, tensor in weights:
        parts = name.split(".", 3)
        if name == "model.embed_tokens.weight":
            top["embed"] = to_numpy(tensor.to(dtype))
        elif name == "model.final_layernorm.weight":
            top["final_norm"] = to_numpy(tensor.to(dtype))
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                top["lm_head"] = to_numpy(tensor.to(dtype)).T
        elif len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _NAMES:
            ours, transpose = _NAMES[parts[3]]
            t = tensor.float() if ours in _FLOAT32 else tensor.to(dtype)
            array = to_numpy(t.squeeze(1) if ours == "conv_w" else t)
            layers[int(parts[2])][ours] = array.T if transpose else array
        else:
            raise KeyError(f"checkpoint weight {name!r} has no parameter in the tpu runner's bamba")
    for i, layer in enumerate(layers):
        needed = ({"in_proj", "conv_w", "dt_bias", "A_log", "D", "norm", "out_proj"}
                  if cfg.layer_is_mamba[i] else {"q", "k", "v", "o"})
        missing = needed | {"input_norm", "pre_ff_norm", "gate", "up", "down"} - set(layer)
        if missing - set(layer):
            raise KeyError(f"checkpoint is missing layer {i}'s {sorted(missing - set(layer))}")
        if "A_log" in layer:
            layer["A"] = -np.exp(layer.pop("A_log"))
        layer.setdefault("conv_b", np.zeros(cfg.conv_dim, np.float32))
    needed = {"embed", "final_norm"} | (set() if cfg.tie_word_embeddings else {"lm_head"})
    if needed - set(top):
        raise KeyError(f"checkpoint is missing {sorted(needed - set(top))}")
    cast = {k: v.astype(target) for k, v in top.items()}
    return {**cast, "layers": layers}


def _attention(w, cfg: BambaConfig, shape: StepShape, h, kv, batch, slot: int, group: int):
    T = h.shape[0]
    q = jnp.dot(h, w["q"], precision=jax.lax.Precision.HIGHEST).reshape(T, cfg.num_heads, -1)
    k = jnp.dot(h, w["k"], precision=jax.lax.Precision.HIGHEST).reshape(T, cfg.num_kv_heads, -1)
    v = jnp.dot(h, w["v"], precision=jax.lax.Precision.HIGHEST).reshape(T, cfg.num_kv_heads, -1)
    cos_sin = batch["rope"][batch["positions"]]
    q, k = rotary(q, cos_sin), rotary(k, cos_sin)
    kv = write_kv(kv, jnp.int32(slot), k, v, batch["slots"][group])
    out = ragged_paged_attention(
        gather_tiles(q, batch["tile_token"], shape.tile_size), kv, jnp.array([slot], jnp.int32),
        jnp.zeros((1,), jnp.int32), batch["tile_seq"], batch["tile_pos"], batch["tile_len"],
        batch["seq_lens"], batch["block_tables"][group], scale=cfg.head_size**-0.5,
        interpret=shape.interpret,
    )
    attn = out[batch["token_tile"], batch["token_row"]].reshape(T, -1)
    return jnp.dot(attn, w["o"], precision=jax.lax.Precision.HIGHEST), kv, k, v


def _mamba(w, cfg: BambaConfig, h, batch, marks, conv0, ssm0):
    proj = jnp.dot(h, w["in_proj"], precision=jax.lax.Precision.HIGHEST)
    gate, xbc, dt = jnp.split(proj, [cfg.mamba_inner, cfg.mamba_inner + cfg.conv_dim], axis=-1)
    seq = batch["seq_token"]  # [S, L] -> flat token index
    y, conv, ssm, conv_m, ssm_m = mamba2_mixer(
        w, cfg, xbc[seq], dt[seq], batch["seq_len"], conv0, ssm0, marks,
    )
    y = y[batch["token_seq"], batch["token_pos"]]
    y = gated_rms_norm(y, gate, w["norm"], cfg.rms_norm_eps, cfg.mamba_groups)
    out = jnp.dot(y, w["out_proj"], precision=jax.lax.Precision.HIGHEST)
    return out, (conv, ssm, conv_m, ssm_m)


@partial(jax.jit, static_argnames=("cfg", "shape", "layout"))
def forward_bamba(params, kv, states, batch, *, cfg: BambaConfig, shape: StepShape,
                  layout: tuple[tuple[int, int], ...]):
    """One step: (logits [rows, vocab] float32, keys and values [layers, T, kv_heads, D]
    (zeros for Mamba2 layers), per Mamba2 layer (conv, ssm, conv at marks, ssm at marks)).
    `states`: per Mamba2 layer (conv [S, C, K - 1], ssm [S, H, P, N]) before the step;
    `layout`: per layer its (arena slot, KV group)."""
    hidden = params["embed"][batch["input_ids"]]
    T = hidden.shape[0]
    zeros = jnp.zeros((T, cfg.num_kv_heads, cfg.head_size), kv.dtype)
    keys, values, new_states = [], [], []
    for i, is_mamba in enumerate(cfg.layer_is_mamba):
        w = params["layers"][i]
        h = rms_norm(hidden, w["input_norm"], cfg.rms_norm_eps, False)
        if is_mamba:
            m = len(new_states)
            out, st = _mamba(w, cfg, h, batch, batch["marks"][m], *states[m])
            new_states.append(st)
            k, v = zeros, zeros
        else:
            out, kv, k, v = _attention(w, cfg, shape, h, kv, batch, *layout[i])
        keys.append(k.astype(kv.dtype))
        values.append(v.astype(kv.dtype))
        hidden = hidden + out
        h = rms_norm(hidden, w["pre_ff_norm"], cfg.rms_norm_eps, False)
        gate = jnp.dot(h, w["gate"], precision=jax.lax.Precision.HIGHEST)
        up = jnp.dot(h, w["up"], precision=jax.lax.Precision.HIGHEST)
        hidden = hidden + jnp.dot(jax.nn.silu(gate) * up, w["down"],
                                  precision=jax.lax.Precision.HIGHEST)
    rows = rms_norm(hidden[batch["sample_rows"]], params["final_norm"], cfg.rms_norm_eps, False)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    logits = jnp.dot(rows, head, precision=jax.lax.Precision.HIGHEST).astype(jnp.float32)
    return logits, jnp.stack(keys), jnp.stack(values), new_states


class TpuBambaRunner(TpuModelRunner):
    """`TpuModelRunner` for Bamba: full attention over the arena's pages, Mamba2 layers over
    recurrent states in their state slots' pages (see the module docstring)."""

    @classmethod
    def from_context(cls, context: ModelRunnerContext, *, interpret: bool,
                     tensor_parallel_size: int) -> TpuBambaRunner:
        if tensor_parallel_size != 1:
            raise ValueError(f"the tpu runner serves bamba on one device; got tensor parallel "
                             f"{tensor_parallel_size} ($TOKENMILL_TPU_TENSOR_PARALLEL)")
        cfg = bamba_config(context.hf_config)
        params = convert_bamba_weights(cfg, context.weights(), context.dtype)
        rope = build_cos_sin_cache(rope_parameters(context.hf_config), cfg.rotary_dim,
                                   context.hf_config.max_position_embeddings, device=None)
        kv = context.kv_cache
        return cls(
            cfg, params, rope.numpy(), specs=kv.attention_specs, layer_slots=kv.layer_slots,
            layer_groups=kv.layer_groups, block_size=kv.block_size,
            max_model_len=context.max_model_len, dtype=context.dtype, interpret=interpret,
            seed=context.seed,
        )

    def _place(self, params: dict[str, Any]) -> dict[str, Any]:
        return jax.device_put(params, self.mesh.devices.flat[0])

    def capabilities(self) -> RunnerCapabilities:
        """Full attention and Mamba2 (LINEAR) layers; KV and states stay in the worker's
        pages between steps, so KV offload works."""
        return RunnerCapabilities(
            attention_kinds=frozenset({AttentionKind.FULL, AttentionKind.LINEAR}),
            kv_offload=True,
        )

    def _mamba_layers(self) -> list[int]:
        return [j for j, s in enumerate(self.specs) if s.kind == AttentionKind.LINEAR]

    def _run(self, inputs: dict, batch: list[ScheduledRow]) -> jax.Array:
        num_seqs = len(inputs["seq_lens"])
        self._add_sequence_layout(inputs, batch, num_seqs)
        states = self._read_states(batch, num_seqs)
        layout = tuple(zip(self.layer_slots.tolist(), self.layer_groups.tolist()))
        logits, keys, values, new_states = forward_bamba(
            self.params, self._arena(), states, inputs, cfg=self.cfg, shape=self.shape,
            layout=layout,
        )
        self._write_back(keys, values, inputs["slots"], sum(r.num_tokens for r in batch))
        self._write_states(batch, new_states)
        return logits

    def _add_sequence_layout(self, inputs: dict, batch: list[ScheduledRow], num_seqs: int):
        """Each sequence's tokens as a padded row (the mixer runs per sequence) and each
        Mamba2 layer's checkpoint offsets (token counts into the step, -1: none)."""
        longest = bucket(max(r.num_tokens for r in batch), 16)
        seq_token = np.zeros((num_seqs, longest), np.int32)
        token_seq = np.zeros(len(inputs["input_ids"]), np.int32)
        token_pos = np.zeros(len(inputs["input_ids"]), np.int32)
        offset = 0
        for i, row in enumerate(batch):
            n = row.num_tokens
            seq_token[i, :n] = np.arange(offset, offset + n)
            token_seq[offset : offset + n], token_pos[offset : offset + n] = i, np.arange(n)
            offset += n
        layers = self._mamba_layers()
        marks = [[[c - r.start for c, _ in self._ops(r, j).checkpoints] for r in batch]
                 for j in layers]
        width = bucket(max((len(m) for per in marks for m in per), default=0), 1)
        table = np.full((len(layers), num_seqs, width), -1, np.int32)
        for m, per in enumerate(marks):
            for i, row_marks in enumerate(per):
                table[m, i, : len(row_marks)] = row_marks
        seq_len = np.zeros(num_seqs, np.int32)
        seq_len[: len(batch)] = [r.num_tokens for r in batch]
        inputs.update(seq_token=seq_token, token_seq=token_seq, token_pos=token_pos,
                      seq_len=seq_len, marks=table)

    def _ops(self, row: ScheduledRow, layer: int) -> RecurrentStateOps:
        group = int(self.layer_groups[layer])
        return row.state.recurrent_ops.get(group) or RecurrentStateOps(group)

    def _read_states(self, batch: list[ScheduledRow], num_seqs: int):
        """Per Mamba2 layer (conv [S, C, K - 1], ssm [S, H, P, N]) before the step: a
        restored checkpoint, the slot's state, or zeros at token 0."""
        states = []
        for j in self._mamba_layers():
            spec, cache = self.specs[j].state, self.pages.layer_caches[j]
            conv, ssm = zero_states(spec, num_seqs, torch.device("cpu"))
            for i, row in enumerate(batch):
                op = self._ops(row, j)
                ids = (list(op.restore_block_ids) if op.restore_block_ids else
                       row.state.tables()[int(self.layer_groups[j])] if row.start > 0 else None)
                if ids is not None:
                    c, s = read_states(cache, spec, [ids])
                    conv[i], ssm[i] = c[0], s[0]
            states.append((to_numpy(conv), to_numpy(ssm)))
        return states

    def _write_states(self, batch: list[ScheduledRow], new_states) -> None:
        """Each sequence's state after the step into its slot; the checkpoints the step
        asks for into their pages."""
        for j, (conv, ssm, conv_m, ssm_m) in zip(self._mamba_layers(), new_states, strict=True):
            spec, cache = self.specs[j].state, self.pages.layer_caches[j]
            conv, ssm = to_torch(conv), to_torch(ssm)
            conv_m, ssm_m = to_torch(conv_m), to_torch(ssm_m)
            slots = [row.state.tables()[int(self.layer_groups[j])] for row in batch]
            n = len(batch)
            write_states(cache, spec, slots, [conv[:n], ssm[:n]])
            for i, row in enumerate(batch):
                for m, (_, ids) in enumerate(self._ops(row, j).checkpoints):
                    write_states(cache, spec, [list(ids)], [conv_m[i, m : m + 1],
                                                           ssm_m[i, m : m + 1]])
