"""Ragged paged attention in Pallas, and the KV layout it reads.

KV layout: the contract's (tokenmill.platforms.interfaces.kv_cache_shape), so the kernel
reads the worker's KV arena as it is: `kv [num_slots, 2, num_blocks, block_size,
num_kv_heads, head_size]`, arena slot s's keys at [s, 0] and values at [s, 1] (a layer
reads the slot the core's KV-group plan gives it, with its group's block table). Each
program copies one page's keys and values of its KV head from HBM to VMEM in one strided
DMA (`kv[slot, :, block, :, head]`). (JAX's own TPU kernel interleaves keys and values
per head so that the copy is contiguous; reading the arena in place is worth the stride.)

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
from jax.experimental.pallas import tpu as pltpu

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
    kv: jax.Array, slot: jax.Array, key: jax.Array, value: jax.Array, slots: jax.Array
) -> jax.Array:
    """`kv` with arena slot `slot`'s token slots set to the step's keys and values.

    key/value [T, kv_heads, head_size]; slots int32 [T] (block * block_size + offset);
    a slot out of range (>= num_blocks * block_size, used for padding tokens) is dropped.
    """
    num_slots, _, num_blocks, block_size, heads, head_size = kv.shape
    flat = kv.reshape(num_slots, 2, num_blocks * block_size, heads, head_size)
    flat = flat.at[slot, 0, slots].set(key.astype(kv.dtype), mode="drop")
    flat = flat.at[slot, 1, slots].set(value.astype(kv.dtype), mode="drop")
    return flat.reshape(kv.shape)


def _head_rows(page_ref, kv: int, row, span: int) -> jax.Array:
    """[block_size, head_size]: keys (kv 0) or values (kv 1) of head `row` (traced, below
    `span`) of the copied page, read with static indices only (Mosaic indexes the
    second-minor axis statically)."""
    out = page_ref[kv, :, 0, :]
    for j in range(1, span):
        out = jnp.where(row == j, page_ref[kv, :, j, :], out)
    return out


def _kernel(
    # scalar inputs
    layer_ref, window_ref, tile_seq_ref, tile_pos_ref, tile_len_ref, seq_lens_ref, tables_ref,
    # blocks
    q_ref,  # [1, 1, tile * group, head_size]: the tile's rows of one KV head's group
    kv_ref,  # the whole arena [slots, 2, blocks, block_size, kv_heads, head_size], in HBM
    o_ref,  # [1, 1, tile * group, head_size]
    page_ref,  # VMEM [2, block_size, span, head_size]: a page's keys and values of `span`
    # KV heads, this program's among them
    sem,  # the DMA semaphore of the page copy
    *,
    scale: float,
    block_size: int,
    tile: int,
    span: int,
):
    t, h = pl.program_id(0), pl.program_id(1)
    _, _, tile_rows, head_size = q_ref.shape
    group = tile_rows // tile
    layer, window = layer_ref[0], window_ref[0]
    seq, first, rows = tile_seq_ref[t], tile_pos_ref[t], tile_len_ref[t]
    seq_len = seq_lens_ref[seq]
    q = q_ref[0, 0].astype(jnp.float32)
    row = jax.lax.broadcasted_iota(jnp.int32, (tile * group, 1), 0) // group
    q_pos = first + row  # [tile * group, 1]
    last = first + rows - 1
    lo = jnp.where(window > 0, jnp.maximum(first - window + 1, 0), 0)
    num_pages = jnp.where(rows > 0, last // block_size - lo // block_size + 1, 0)

    def page_step(i, carry):
        m, denom, acc = carry
        p = lo // block_size + i
        block = tables_ref[seq, p]
        heads = pl.ds(pl.multiple_of((h // span) * span, span), span)
        copy = pltpu.make_async_copy(kv_ref.at[layer, :, block, :, heads], page_ref, sem)
        copy.start()
        copy.wait()
        k_pos = p * block_size + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        # [block_size, 1] from its own iota: Mosaic cannot reshape a vector of booleans
        k_col = p * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)
        written = k_col < seq_len
        k = jnp.where(written, _head_rows(page_ref, 0, h % span, span), 0)
        v = jnp.where(written, _head_rows(page_ref, 1, h % span, span), 0)
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
    o_ref[0, 0] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def ragged_paged_attention(
    q_tiles: jax.Array,  # [num_tiles, tile, num_heads, head_size]
    kv: jax.Array,  # [slots, 2, blocks, block_size, kv_heads, head_size]
    layer: jax.Array,  # int32 [1]: the arena slot the layer reads
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
    _, _, _, block_size, num_kv_heads, _ = kv.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    scalars = [layer, window, tile_seq, tile_pos, tile_len, seq_lens, block_tables]
    # [tiles, kv_heads, tile * group, D]: a program's block spans the last two dims whole,
    # as Mosaic wants (a [tile, group] block of [tile, heads] is not (8, 128)-aligned)
    rows = tile * group
    q_groups = q_tiles.reshape(num_tiles, tile, num_kv_heads, group, head_size)
    q_groups = q_groups.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows, head_size)
    q_spec = pl.BlockSpec((1, 1, rows, head_size), lambda t, h, *_: (t, h, 0, 0))
    # the step's scalars go to SMEM ahead of the grid; pages are copied HBM -> VMEM, `span`
    # KV heads at a time: a copy's head offset must be a multiple of the dtype's packing
    # (2 for 16-bit, 4 for 8-bit), or the page's whole head axis where that does not divide
    pack = max(1, 4 // jnp.dtype(kv.dtype).itemsize)
    span = pack if num_kv_heads % pack == 0 else num_kv_heads
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(num_tiles, num_kv_heads),
        in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((2, block_size, span, head_size), kv.dtype),
                        pltpu.SemaphoreType.DMA(())],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_size=block_size, tile=tile, span=span),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_groups.shape, q_tiles.dtype),
        interpret=interpret,
        name="tokenmill_ragged_paged_attention",
    )(*scalars, q_groups, kv)
    out = out.reshape(num_tiles, num_kv_heads, tile, group, head_size).transpose(0, 2, 1, 3, 4)
    return out.reshape(q_tiles.shape)
