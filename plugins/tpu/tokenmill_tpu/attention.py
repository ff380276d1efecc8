"""The attention backend the core sees: torch tensors in, the Pallas kernel inside.

The core's model runner (and conformance tier T1) call `forward` with torch tensors and a
torch KV cache in the contract's layout `[2, num_blocks, block_size, kv_heads, head]`,
which the kernel reads as it is (`tokenmill_tpu.kernels`). This backend runs the KV
write and the ragged paged attention kernel in one jitted call and writes the cache back:
a host round trip per layer. It exists so the kernel is certified against the core's
reference and so the core's torch graph can run on this platform; the plugin's own
runner (`tokenmill_tpu.runner`) runs a whole step in one call.

Shapes are padded to buckets (`tokenmill_tpu.buckets`) and the sliding window is a
runtime value, so the kernel compiles once per bucket, not once per step or window.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill_tpu.buckets import bucket
from tokenmill_tpu.convert import numpy_dtype, to_numpy, to_torch
from tokenmill_tpu.kernels import TilePlan, plan_tiles, ragged_paged_attention, write_kv

SUPPORTED_DTYPES = frozenset({torch.float32, torch.bfloat16})
TILE_SIZE = 8


def gather_tiles(x: jax.Array, plan_tile_token: jax.Array, tile_size: int) -> jax.Array:
    """[tokens, ...] -> [tiles, tile_size, ...]: each tile's rows (past the end: clipped)."""
    rows = plan_tile_token[:, None] + jnp.arange(tile_size, dtype=jnp.int32)[None]
    return x[jnp.minimum(rows, x.shape[0] - 1)]


@functools.partial(jax.jit, static_argnames=("scale", "interpret"), donate_argnums=(3,))
def _attend(q, k, v, kv, slots, window, tile_seq, tile_pos, tile_len, tile_token,
            token_tile, token_row, seq_lens, tables, *, scale, interpret):
    layer = jnp.zeros((1,), jnp.int32)
    kv = write_kv(kv, layer[0], k, v, slots)
    q_tiles = gather_tiles(q, tile_token, TILE_SIZE)
    out = ragged_paged_attention(
        q_tiles, kv, layer, window, tile_seq, tile_pos, tile_len, seq_lens, tables,
        scale=scale, interpret=interpret,
    )
    return out[token_tile, token_row], kv


class PallasPagedAttention(AttentionBackend):
    """FULL or SLIDING_WINDOW attention of torch tensors through the Pallas kernel."""

    def __init__(self, kind: AttentionKind, interpret: bool) -> None:
        if kind not in (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW):
            raise ValueError(f"PallasPagedAttention implements full and sliding window, not {kind}")
        self.kind = kind
        self.name = f"pallas_ragged_{kind.value}"
        self.interpret = interpret

    def supports(self, spec: AttentionSpec) -> bool:
        windowed = spec.sliding_window is not None
        return (
            spec.kind == self.kind
            and windowed == (self.kind == AttentionKind.SLIDING_WINDOW)
            and (not windowed or spec.sliding_window > 0)
            and spec.dtype in SUPPORTED_DTYPES
            and spec.num_heads % spec.num_kv_heads == 0
            and not spec.sinks  # gpt-oss sink logits: not in the kernel (the core's reference runs them)
        )

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Plans the step's query tiles once; every layer of the step reuses the plan."""
        metadata.backend_state[self.name] = _plan(metadata)

    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Writes key/value into `kv_cache` at `metadata.slot_mapping`, then attends; does
        not modify its other inputs."""
        plan, padded = metadata.backend_state.get(self.name) or _plan(metadata)
        num_tokens = metadata.num_tokens
        tokens = padded["tokens"]
        _, num_blocks, block_size, kv_heads, head = kv_cache.shape
        cache_dtype = numpy_dtype(kv_cache.dtype)
        blocks = bucket(num_blocks, 16)
        kv = np.zeros((1, 2, blocks, block_size, kv_heads, head), cache_dtype)
        kv[0, :, :num_blocks] = to_numpy(kv_cache)  # [2, blocks, block_size, kv_heads, head]
        slots = np.full(tokens, blocks * block_size, np.int32)  # padding: dropped
        slots[:num_tokens] = to_numpy(metadata.slot_mapping).astype(np.int32)

        def pad(t: torch.Tensor) -> np.ndarray:
            x = to_numpy(t.to(kv_cache.dtype))
            return np.concatenate([x, np.zeros((tokens - num_tokens, *x.shape[1:]), x.dtype)])

        scale = spec.scale if spec.scale is not None else spec.head_size**-0.5
        out, kv = _attend(
            pad(query), pad(key), pad(value), kv, slots,
            np.array([spec.sliding_window or 0], np.int32),
            plan.tile_seq, plan.tile_pos, plan.tile_len, plan.tile_token,
            plan.token_tile, plan.token_row, padded["seq_lens"], padded["tables"],
            scale=float(scale), interpret=self.interpret,
        )
        kv_cache.copy_(to_torch(np.asarray(kv)[0, :, :num_blocks]))
        return to_torch(np.asarray(out)[:num_tokens]).to(query.dtype).to(query.device)


def _plan(metadata: AttentionMetadata) -> tuple[TilePlan, dict[str, np.ndarray | int]]:
    num_seqs = bucket(metadata.num_seqs, 4)
    tokens = bucket(metadata.num_tokens, 16)
    tiles = bucket(metadata.num_seqs + -(-metadata.num_tokens // TILE_SIZE), 4)
    tables = to_numpy(metadata.block_tables).astype(np.int32)
    padded_tables = np.zeros((num_seqs, bucket(tables.shape[1], 4)), np.int32)
    padded_tables[: tables.shape[0], : tables.shape[1]] = tables
    seq_lens = np.zeros(num_seqs, np.int32)
    seq_lens[: metadata.num_seqs] = metadata.seq_lens_cpu
    plan = plan_tiles(metadata.query_lens_cpu, metadata.seq_lens_cpu, TILE_SIZE, tiles, tokens)
    return plan, {"tokens": tokens, "seq_lens": seq_lens, "tables": padded_tables}
