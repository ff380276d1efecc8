"""The core's reference for recurrent (LINEAR) layers: one backend, one variant per
recurrence, states in the KV arena's pages.

`ReferenceLinearAttentionBackend` runs any variant of `REFERENCE_VARIANTS` (the spec's
`state.variant` picks it). Per sequence of the step it reads the state (zeros at token
0, a prefix-cache checkpoint the first step after a hit, else its slot), cuts the
query at the checkpoints the step asks for, runs the variant over each piece carrying
the state, writes each checkpoint and finally the slot. A variant therefore only maps
(its inputs for tokens [lo, hi) of one sequence, the state before) to (outputs, the
state after): a chunked scan for prefill pieces, the recurrence for single tokens.

Adding a variant (Mamba2, KDA): an inputs dataclass, a `LinearVariant` with `run`, a
`*_state_spec` helper for the model to declare its state, and one entry in
`REFERENCE_VARIANTS`. The dispatch below does not change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import torch

from tokenmill.platforms.interfaces import (
    AttentionMetadata,
    AttentionSpec,
    LinearAttentionBackend,
    RecurrentStateSpec,
    StateTensorSpec,
)
from tokenmill.platforms.kit.kv_state import read_states, write_states, zero_states
from tokenmill.platforms.ops.gated_delta import (
    causal_conv1d,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from tokenmill.platforms.ops.kda import kda_chunked, kda_recurrent
from tokenmill.platforms.ops.mamba2 import Mamba2


class LinearVariant(Protocol):
    """One recurrence: its outputs and new state for tokens [lo, hi) of one sequence."""

    def run(
        self, spec: AttentionSpec, inputs: Any, lo: int, hi: int, state: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`state`: the spec's state tensors without the batch dim, the state before token
        lo; returns (outputs [hi - lo, ...], the state after token hi - 1). Must not modify
        `state` in place (it may be a checkpoint's copy that other pieces still need)."""
        ...


# ---- Gated DeltaNet (Qwen3-Next, Qwen3.5) ---------------------------------------------


@dataclass(slots=True)
class GatedDeltaInputs:
    """A Gated DeltaNet layer's inputs for the step's tokens (flattened as the metadata).

    mixed_qkv [T, 2 * Hk * dk + Hv * dv]: the projections before the causal conv, q then
    k then v (head-major within each); g [T, Hv] float32: log decay (<= 0); beta [T, Hv]:
    the learning rate in (0, 1). The conv is depthwise over mixed_qkv's channels with
    `conv_weight` [C, K] (+ `conv_bias` [C]) and SiLU.
    """

    mixed_qkv: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    num_k_heads: int
    head_k_dim: int
    num_v_heads: int
    head_v_dim: int


def gated_delta_state_spec(
    conv_dim: int, conv_kernel: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
    conv_dtype: torch.dtype, conv_parts: tuple[int, ...] = (),
) -> RecurrentStateSpec:
    """The state of one Gated DeltaNet layer: the conv's last K - 1 inputs [C, K - 1] in
    the model dtype, and the delta-rule state [Hv, dk, dv] in float32. `conv_parts`: the
    conv channels' runs as tensor parallel splits them (q, k, v; `StateTensorSpec.parts`),
    where the model declares them."""
    return RecurrentStateSpec(
        "gated_delta",
        (
            StateTensorSpec("conv", (conv_dim, conv_kernel - 1), conv_dtype, conv_parts),
            StateTensorSpec("ssm", (num_v_heads, head_k_dim, head_v_dim), torch.float32,
                            (num_v_heads,) if conv_parts else ()),
        ),
    )


class GatedDelta:
    """Causal conv with state, then the gated delta rule (platforms/ops/gated_delta.py)."""

    chunk_size = 64

    def run(
        self, spec: AttentionSpec, inputs: GatedDeltaInputs, lo: int, hi: int,
        state: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        conv_state, ssm = state
        mixed, conv_state = causal_conv1d(
            inputs.mixed_qkv[lo:hi], inputs.conv_weight, conv_state, inputs.conv_bias
        )
        q, k, v = split_qkv(mixed, inputs)
        g, beta = inputs.g[lo:hi], inputs.beta[lo:hi]
        if hi - lo == 1:
            out, ssm = gated_delta_rule_recurrent(q, k, v, g, beta, ssm)
        else:
            out, ssm = gated_delta_rule_chunked(q, k, v, g, beta, ssm, chunk_size=self.chunk_size)
        return out, [conv_state, ssm]


def split_qkv(
    mixed: torch.Tensor, inputs: GatedDeltaInputs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's output [T, C] -> q, k [T, Hk, dk] and v [T, Hv, dv]."""
    key_dim = inputs.num_k_heads * inputs.head_k_dim
    q, k, v = mixed.split((key_dim, key_dim, inputs.num_v_heads * inputs.head_v_dim), dim=-1)
    t = mixed.shape[0]
    return (
        q.reshape(t, inputs.num_k_heads, inputs.head_k_dim),
        k.reshape(t, inputs.num_k_heads, inputs.head_k_dim),
        v.reshape(t, inputs.num_v_heads, inputs.head_v_dim),
    )


# ---- Kimi Delta Attention (Kimi Linear) -----------------------------------------------


@dataclass(slots=True)
class KDAInputs:
    """A KDA layer's inputs for the step's tokens (flattened as the metadata).

    mixed_qkv [T, 3 * H * d]: q, k, v projections before the causal conv (head-major
    within each; KDA has as many key as value heads and d = dk = dv); g [T, H, d]
    float32: log decay per key channel (<= 0); beta [T, H]: the learning rate in (0, 1).
    The conv is depthwise over mixed_qkv's channels with `conv_weight` [C, K] and SiLU.
    """

    mixed_qkv: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    conv_weight: torch.Tensor
    num_heads: int
    head_dim: int


def kda_state_spec(
    num_heads: int, head_dim: int, conv_kernel: int, conv_dtype: torch.dtype
) -> RecurrentStateSpec:
    """The state of one KDA layer: the conv's last K - 1 inputs [3 H d, K - 1] in the
    model dtype, and the delta-rule state [H, d, d] in float32. Tensor parallel runs
    (`StateTensorSpec.parts`): the conv's q, k and v channels, the state's heads."""
    size = num_heads * head_dim
    return RecurrentStateSpec(
        "kda",
        (
            StateTensorSpec("conv", (3 * size, conv_kernel - 1), conv_dtype, (size,) * 3),
            StateTensorSpec("ssm", (num_heads, head_dim, head_dim), torch.float32, (num_heads,)),
        ),
    )


class KimiDelta:
    """Causal conv with state, then KDA's per-channel gated delta rule (platforms/ops/kda.py)."""

    chunk_size = 64

    def run(
        self, spec: AttentionSpec, inputs: KDAInputs, lo: int, hi: int,
        state: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        conv_state, ssm = state
        mixed, conv_state = causal_conv1d(inputs.mixed_qkv[lo:hi], inputs.conv_weight, conv_state)
        q, k, v = (t.reshape(hi - lo, inputs.num_heads, inputs.head_dim)
                   for t in mixed.chunk(3, dim=-1))
        g, beta = inputs.g[lo:hi], inputs.beta[lo:hi]
        if hi - lo == 1:
            out, ssm = kda_recurrent(q, k, v, g, beta, ssm)
        else:
            out, ssm = kda_chunked(q, k, v, g, beta, ssm, chunk_size=self.chunk_size)
        return out, [conv_state, ssm]


REFERENCE_VARIANTS: Mapping[str, LinearVariant] = MappingProxyType(
    {"gated_delta": GatedDelta(), "kda": KimiDelta(), "mamba2": Mamba2()}
)


# ---- the backend --------------------------------------------------------------------


def initial_state(
    cache: torch.Tensor, spec: RecurrentStateSpec, source: list[int] | None
) -> list[torch.Tensor]:
    """One sequence's state before its query (batch dim dropped): zeros, or the pages'."""
    states = zero_states(spec, 1, cache.device) if source is None else read_states(cache, spec, [source])
    return [t[0] for t in states]


class ReferenceLinearAttentionBackend(LinearAttentionBackend):
    """Every variant of `variants`, sequence by sequence, in plain torch."""

    name = "reference_linear"

    def __init__(self, variants: Mapping[str, LinearVariant] = REFERENCE_VARIANTS) -> None:
        self._impls = dict(variants)
        self.variants = frozenset(variants)

    def forward(  # type: ignore[override]
        self,
        spec: AttentionSpec,
        inputs: Any,
        state_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        starts = metadata.query_start_loc.tolist()
        return torch.cat([
            self.forward_sequence(spec, inputs, state_cache, metadata, i, starts[i], starts[i + 1])
            for i in range(metadata.num_seqs)
        ])

    def forward_sequence(
        self, spec: AttentionSpec, inputs: Any, state_cache: torch.Tensor,
        metadata: AttentionMetadata, i: int, lo: int, hi: int,
    ) -> torch.Tensor:
        """Sequence i (tokens [lo, hi) of the step): read its state, run the variant piece
        by piece between its checkpoints, write them and its slot; returns its outputs."""
        variant = self._impls[spec.state.variant]
        rec = metadata.recurrent
        state = initial_state(state_cache, spec.state, rec.source_block_ids[i])
        outs, at = [], lo
        for n, pages in rec.checkpoints[i]:
            if lo + n > at:
                out, state = variant.run(spec, inputs, at, lo + n, state)
                outs.append(out)
                at = lo + n
            write_states(state_cache, spec.state, [pages], [t[None] for t in state])
        if at < hi:
            out, state = variant.run(spec, inputs, at, hi, state)
            outs.append(out)
        write_states(state_cache, spec.state, [rec.state_block_ids[i]], [t[None] for t in state])
        return torch.cat(outs)
