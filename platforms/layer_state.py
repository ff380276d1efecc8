"""What a layer beyond plain multi-head attention keeps per sequence, as the plugin seam
declares it: the recurrent state of LINEAR layers (`RecurrentStateSpec`, where it lives in
a step: `RecurrentStateMetadata`) and the shapes of an MLA layer's latent cache (`MLADims`).
Pure data; `tokenmill.platforms.interfaces` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class StateTensorSpec:
    """One tensor of a recurrent layer's per-sequence state (e.g. "conv" [C, K - 1] or
    "ssm" [H, dk, dv]); shape without the batch dimension.

    `parts`: how tensor parallel splits it, when declared: dim 0 is these runs of rows in
    order (Gated DeltaNet's conv: its q, k and v channels; its ssm: one run of heads),
    each split evenly over the ranks, a rank holding its share of every run in the same
    order. Empty: not declared (a handover between engines of different tensor parallel
    sizes then refuses to reshard it)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[int, ...] = ()

    @property
    def num_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


# Each state tensor starts at a multiple of this many bytes in the packed state.
STATE_ALIGN = 64


@dataclass(frozen=True, slots=True)
class RecurrentStateSpec:
    """What a recurrent (LINEAR) layer keeps per running sequence, and which computation
    updates it. `variant` names the recurrence ("gated_delta": Gated DeltaNet; "mamba2",
    "kda"...): a `LinearAttentionBackend` dispatches on it. The arena packs the tensors
    in order, each at a multiple of STATE_ALIGN bytes (`offsets`), into as many pages as
    `num_bytes` needs; it fixes nothing else about them."""

    variant: str
    tensors: tuple[StateTensorSpec, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each tensor in the packed state."""
        out, at = [], 0
        for t in self.tensors:
            out.append(at)
            at += -(-t.num_bytes // STATE_ALIGN) * STATE_ALIGN
        return tuple(out)

    @property
    def num_bytes(self) -> int:
        """Bytes of one sequence's packed state in one layer."""
        if not self.tensors:
            return 0
        return self.offsets[-1] + self.tensors[-1].num_bytes


@dataclass(frozen=True, slots=True)
class MLADims:
    """The shapes of a multi-head latent attention layer (DeepSeek-V2/V3, Kimi).

    Per token the cache keeps one latent row of `kv_lora_rank + qk_rope_head_dim`
    values: the normalised compressed KV `c_kv` (kv_lora_rank), then the rotary key
    `k_pe` (qk_rope_head_dim) shared by every head. Head h's key is
    `cat(W_UK[h] @ c_kv, k_pe)` and its value `W_UV[h] @ c_kv`, with the up-projections
    `w_uk` [num_heads, qk_nope_head_dim, kv_lora_rank] and `w_uv` [num_heads, v_head_dim,
    kv_lora_rank] (rows of the checkpoint's `kv_b_proj`).
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_size(self) -> int:
        """Values cached per token per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(slots=True)
class RecurrentStateMetadata:
    """Where each sequence's recurrent state lives in one step, for one KV group of LINEAR
    layers (core/kv/recurrent.py). Block ids name pages of the arena, as block tables do;
    a layer reads and writes them through `tokenmill.platforms.kit.kv_state` (`read_states`,
    `write_states`) on its own state cache.

    Per sequence, in batch order:
    - `state_block_ids[i]`: the sequence's own state slot; after the step it must hold
      the state after the sequence's last computed token.
    - `source_block_ids[i]`: where the state before the query's first token is read:
      the slot itself, a prefix-cache checkpoint (the first step after a hit: read only,
      never written; the new state goes to the slot: copy on extend), or None for a
      sequence that starts at token 0 (zero state; the pages may hold anything).
    - `checkpoints[i]`: (n, block ids) pairs, n ascending in [1, query_len]: write the
      state after the query's first n tokens into those pages (prefix-cache checkpoints
      at block boundaries; n == query_len is the state after the step).
    """

    state_block_ids: list[list[int]]
    source_block_ids: list[list[int] | None]
    checkpoints: list[list[tuple[int, list[int]]]]
