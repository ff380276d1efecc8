"""Ragged paged attention in Pallas, and the KV layout it reads.

KV layout (the plugin's own; the core only hands out block ids): every layer's pages live
in one array `kv [num_layers, num_blocks, block_size, 2 * num_kv_heads, head_size]`, keys
and values of a KV head interleaved on the third axis (2h = key, 2h + 1 = value). One page
read brings a block's keys and values together, the layout JAX's own TPU kernel uses.

The kernel takes a whole engine step, prefill chunks and decodes alike, as *query tiles*:
a tile is up to `tile_size` consecutive query tokens of one sequence (a decode is a tile
of one). The host plans the tiles (`plan_tiles`); the grid is (tiles, KV heads), and each
program attends the grouped query heads of its KV head (GQA without expanding keys) to
the pages of its sequence from the first one inside the sliding window (0 = none) to the
one holding its last query, with an online softmax in float32. Key slots at or past the
sequence's length are zeroed before use, so unwritten pages (which may hold NaN) never
reach the output. Padding tiles have no query rows and produce zeros.

On JAX's CPU backend the kernel runs with `interpret=True`; on a TPU it is compiled by
Mosaic. See docs/tpu.md for why this kernel and not `jax.experimental.pallas.ops.tpu`'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

_MASKED = -1e30  # finite: a fully masked page must not turn the running max into NaN


@dataclass(frozen=True, slots=True)
class TilePlan:
    """Host-side int32 arrays describing one step's query tiles (see `plan_tiles`)."""

    tile_seq: np.ndarray  # [num_tiles]: the tile's sequence
    tile_pos: np.ndarray  # [num_tiles]: position (in its sequence) of the tile's first query
    tile_len: np.ndarray  # [num_tiles]: query rows in the tile (0: padding)
    tile_token: np.ndarray  # [num_tiles]: flat-batch index of the tile's first query
    token_tile: np.ndarray  # [num_tokens]: each token's tile
    token_row: np.ndarray  # [num_tokens]: each token's row in its tile


def plan_tiles(
    query_lens: list[int],
    seq_lens: list[int],
    tile_size: int,
    num_tiles: int,
    num_tokens: int,
) -> TilePlan:
    """Cut each sequence's query tokens (the last query_lens[i] of seq_lens[i], flattened
    sequence by sequence) into tiles of at most `tile_size`, padded to `num_tiles` tiles and
    `num_tokens` tokens. Raises ValueError when the step needs more tiles than that."""
    tile_seq, tile_pos, tile_len, tile_token = [], [], [], []
    token_tile = np.zeros(num_tokens, np.int32)
    token_row = np.zeros(num_tokens, np.int32)
    offset = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for start in range(0, q_len, tile_size):
            rows = min(tile_size, q_len - start)
            token_tile[offset + start : offset + start + rows] = len(tile_seq)
            token_row[offset + start : offset + start + rows] = np.arange(rows)
            tile_seq.append(i)
            tile_pos.append(seq_len - q_len + start)
            tile_len.append(rows)
            tile_token.append(offset + start)
        offset += q_len
    if len(tile_seq) > num_tiles:
        raise ValueError(f"the step needs {len(tile_seq)} query tiles; the bucket has {num_tiles}")
    pad = num_tiles - len(tile_seq)
    # padding tiles point at sequence 0 with no rows: they read nothing
    return TilePlan(
        tile_seq=np.array(tile_seq + [0] * pad, np.int32),
        tile_pos=np.array(tile_pos + [0] * pad, np.int32),
        tile_len=np.array(tile_len + [0] * pad, np.int32),
        tile_token=np.array(tile_token + [0] * pad, np.int32),
        token_tile=token_tile,
        token_row=token_row,
    )


def write_kv(
    kv: jax.Array, layer: jax.Array, key: jax.Array, value: jax.Array, slots: jax.Array
) -> jax.Array:
    """`kv` with layer `layer`'s slots set to the step's keys and values.

    key/value [T, kv_heads, head_size]; slots int32 [T] (block * block_size + offset);
    a slot out of range (>= num_blocks * block_size, used for padding tokens) is dropped.
    """
    num_layers, num_blocks, block_size, heads2, head_size = kv.shape
    rows = jnp.stack([key, value], axis=2).reshape(key.shape[0], heads2, head_size)
    flat = kv.reshape(num_layers, num_blocks * block_size, heads2, head_size)
    flat = flat.at[layer, slots].set(rows.astype(kv.dtype), mode="drop")
    return flat.reshape(kv.shape)


def _kernel(
    # scalar inputs
    layer_ref, window_ref, tile_seq_ref, tile_pos_ref, tile_len_ref, seq_lens_ref, tables_ref,
    # blocks
    q_ref,  # [1, tile, group, head_size]
    kv_ref,  # the whole cache [layers, blocks, block_size, 2 * kv_heads, head_size]
    o_ref,  # [1, tile, group, head_size]
    *,
    scale: float,
    block_size: int,
):
    t, h = pl.program_id(0), pl.program_id(1)
    _, tile, group, head_size = q_ref.shape
    layer, window = layer_ref[0], window_ref[0]
    seq, first, rows = tile_seq_ref[t], tile_pos_ref[t], tile_len_ref[t]
    seq_len = seq_lens_ref[seq]
    q = q_ref[0].astype(jnp.float32).reshape(tile * group, head_size)
    row = jax.lax.broadcasted_iota(jnp.int32, (tile * group, 1), 0) // group
    q_pos = first + row  # [tile * group, 1]
    last = first + rows - 1
    lo = jnp.where(window > 0, jnp.maximum(first - window + 1, 0), 0)
    num_pages = jnp.where(rows > 0, last // block_size - lo // block_size + 1, 0)

    def page_step(i, carry):
        m, denom, acc = carry
        p = lo // block_size + i
        page = kv_ref[layer, tables_ref[seq, p]]  # [block_size, 2 * kv_heads, head_size]
        k_pos = p * block_size + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        written = (k_pos < seq_len).reshape(block_size, 1)
        k = jnp.where(written, jax.lax.dynamic_index_in_dim(page, 2 * h, 1, False), 0)
        v = jnp.where(written, jax.lax.dynamic_index_in_dim(page, 2 * h + 1, 1, False), 0)
        s = jax.lax.dot_general(
            q, k.astype(jnp.float32), (((1,), (1,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
        ) * scale
        visible = (k_pos <= q_pos) & (row < rows)
        visible &= (window <= 0) | (k_pos > q_pos - window)
        s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        probs = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        denom = alpha * denom + probs.sum(axis=1, keepdims=True)
        acc = alpha * acc + jax.lax.dot(
            probs, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
        return m_new, denom, acc

    init = (
        jnp.full((tile * group, 1), _MASKED, jnp.float32),
        jnp.zeros((tile * group, 1), jnp.float32),
        jnp.zeros((tile * group, head_size), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_pages, page_step, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)
    o_ref[0] = out.reshape(tile, group, head_size).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def ragged_paged_attention(
    q_tiles: jax.Array,  # [num_tiles, tile, num_heads, head_size]
    kv: jax.Array,  # [layers, blocks, block_size, 2 * kv_heads, head_size]
    layer: jax.Array,  # int32 [1]
    window: jax.Array,  # int32 [1]: sliding window, 0 for full attention
    tile_seq: jax.Array,  # int32 [num_tiles]
    tile_pos: jax.Array,  # int32 [num_tiles]
    tile_len: jax.Array,  # int32 [num_tiles]
    seq_lens: jax.Array,  # int32 [num_seqs]
    block_tables: jax.Array,  # int32 [num_seqs, pages_per_seq]
    *,
    scale: float,
    interpret: bool,
) -> jax.Array:
    """Attention of every query tile over its sequence's pages; [num_tiles, tile, heads, D].

    The step's keys and values must already be in `kv` (`write_kv`). Does not modify `kv`.
    """
    num_tiles, tile, num_heads, head_size = q_tiles.shape
    _, _, block_size, heads2, _ = kv.shape
    num_kv_heads = heads2 // 2
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    whole = [pl.BlockSpec(memory_space=pl.ANY)]
    scalars = [layer, window, tile_seq, tile_pos, tile_len, seq_lens, block_tables]
    q_spec = pl.BlockSpec((1, tile, group, head_size), lambda t, h: (t, 0, h, 0))
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_size=block_size),
        grid=(num_tiles, num_kv_heads),
        in_specs=whole * len(scalars) + [q_spec] + whole,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q_tiles.dtype),
        interpret=interpret,
        name="tokenmill_ragged_paged_attention",
    )(*scalars, q_tiles, kv)
