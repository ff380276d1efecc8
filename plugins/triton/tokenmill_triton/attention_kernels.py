"""Triton kernels of ragged paged attention: the KV write, the attention, split-K combine.

One launch covers the whole step: prefill chunks, fresh prompts and decodes. The grid's
first axis enumerates query blocks of every sequence (sequence i's blocks start at
`query_start_loc[i] // BLOCK_Q + i`, an upper bound that needs no host-side table, so the
grid depends only on the token and sequence counts, as graph capture wants); each program
finds its sequence by binary search. The second axis is the KV head: a program computes the
query heads of one KV head together (GQA packs them into the tile's rows, so each key tile
is loaded once per group). The optional third axis splits the keys into segments
(split-K): each segment writes a partial result that `combine_segments_kernel` merges.

Keys are read straight from the paged cache, token by token through the block table, so
the key tile size is independent of the page size. A key is loaded only below the
program's last visible position, so unwritten slots (the tail of a last partial block,
possibly NaN) never enter a result.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill_triton.rounding import fp8_bits, to_dtype


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
    num_tokens, num_kv_heads, block_size,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_C: tl.constexpr,  # (head, dim) columns per program: a multiple of HEAD_PAD
    QUANTIZED: tl.constexpr,  # an FP8 cache (viewed as uint8): x / scale[head], saturated
    FP8_MAX: tl.constexpr,  # the format's largest finite value, and its layout (fp8_bits)
    FP8_MANT: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    FP8_BIAS: tl.constexpr,
):
    """Program (t, c): tokens [t * BLOCK_T, ...) x columns [c * BLOCK_C, ...) of their key and
    value rows into their slots (slot < 0: padding, skipped)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    head = cols // HEAD_PAD
    dim = cols % HEAD_PAD
    slot = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    row_ok = slot >= 0
    col_ok = (head < num_kv_heads) & (dim < HEAD)
    mask = row_ok[:, None] & col_ok[None, :]
    t64 = tokens.to(tl.int64)[:, None]
    k = tl.load(key_ptr + t64 * stride_kt + (head * stride_kh + dim)[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + (head * stride_vh + dim)[None, :], mask=mask)
    if QUANTIZED:  # tokenmill.platforms.ops.kv_quant.quantize_kv, per KV head
        k_s = tl.load(k_scale_ptr + head, mask=col_ok, other=1.0)
        v_s = tl.load(v_scale_ptr + head, mask=col_ok, other=1.0)
        k = tl.minimum(tl.maximum(k.to(tl.float32) / k_s[None, :], -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / v_s[None, :], -FP8_MAX), FP8_MAX)
    row = (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_slot
    dest = cache_ptr + row[:, None] + (head * stride_cache_head + dim)[None, :]
    if QUANTIZED:
        tl.store(dest, fp8_bits(k, FP8_MANT, FP8_MIN_EXP, FP8_BIAS), mask=mask)
        tl.store(dest + stride_cache_kv, fp8_bits(v, FP8_MANT, FP8_MIN_EXP, FP8_BIAS), mask=mask)
    else:
        tl.store(dest, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dest + stride_cache_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_sequence(query_start_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first query block index (start_i // BLOCK_Q + i) <= q_block."""
    lo: tl.int32 = 0  # a loop-carried int32 from the start (a Python 0 is a constexpr)
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_attention_kernel(
    q_ptr, out_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, sinks_ptr,
    partial_out_ptr, partial_max_ptr, partial_sum_ptr, k_scale_ptr, v_scale_ptr,
    scale, num_seqs, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table,
    block_size,  # tokens per KV page (a runtime value: one compiled kernel for every size)
    group,  # query heads per KV head (<= GROUP_PAD)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    GROUP_PAD: tl.constexpr,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    TILE_N: tl.constexpr,  # keys per inner tile
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,  # 1: write `out`; > 1: write this segment's partials
    UPCAST: tl.constexpr,  # float32 tiles into tl.dot (bf16 in the interpreter)
    DOT_PRECISION: tl.constexpr,
    RTNE_BF16: tl.constexpr,  # round the bf16 output to nearest even (the interpreter truncates)
    QUANTIZED: tl.constexpr,  # an FP8 cache: keys and values read as stored * scale[kv_head]
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = _find_sequence(query_start_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return  # past this sequence's last query block (the grid is an upper bound)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = local_block * BLOCK_Q + rows // GROUP_PAD  # query index within the sequence
    head_in_group = rows % GROUP_PAD
    row_valid = (token < q_len) & (head_in_group < group)
    head = kv_head * group + head_in_group
    q_pos = context + token  # the query's position in its sequence
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD
    q_offsets = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if QUANTIZED:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)

    # Keys visible to any row of this block: [kv_begin, kv_end).
    last_token = tl.minimum(q_len, (local_block + 1) * BLOCK_Q) - 1
    kv_end = context + last_token + 1
    kv_begin = 0
    if HAS_WINDOW:
        kv_begin = tl.maximum(context + local_block * BLOCK_Q - window + 1, 0)
    tile_begin = kv_begin // TILE_N
    tile_end = tl.cdiv(kv_end, TILE_N)
    if NUM_SEGMENTS > 1:
        per_segment = tl.cdiv(tile_end - tile_begin, NUM_SEGMENTS)
        tile_begin = tile_begin + segment * per_segment
        tile_end = tl.minimum(tile_end, tile_begin + per_segment)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    k_base = cache_ptr + kv_head * stride_cache_head
    v_base = k_base + stride_cache_kv
    table = block_table_ptr + seq.to(tl.int64) * stride_table
    for tile in range(tile_begin, tile_end):
        k_pos = tile * TILE_N + tl.arange(0, TILE_N)
        k_valid = (k_pos < kv_end) & (k_pos >= kv_begin)
        page = tl.load(table + k_pos // block_size, mask=k_valid, other=0).to(tl.int64)
        kv_offsets = page * stride_cache_block + (k_pos % block_size) * stride_cache_slot
        kv_mask = k_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_base + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if QUANTIZED:  # dequantized into the query's dtype for the dots
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # a row with nothing visible yet keeps -inf; subtract 0 instead so exp gives 0, not NaN
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp(scores - safe_max[:, None])
        alpha = tl.exp(running_max - safe_max)
        running_sum = running_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        running_max = new_max

    if NUM_SEGMENTS == 1:
        if HAS_SINKS:  # a per-head logit in the softmax's denominator that carries no value
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf")).to(tl.float32)
            total_max = tl.maximum(running_max, sink)
            safe_total = tl.where(total_max == float("-inf"), 0.0, total_max)
            rescale = tl.exp(running_max - safe_total)
            running_sum = running_sum * rescale + tl.exp(sink - safe_total)
            acc = acc * rescale[:, None]
        result = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        o_offsets = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(out_ptr + o_offsets + dims[None, :],
                 to_dtype(result, out_ptr.dtype.element_ty, RTNE_BF16), mask=q_mask)
    else:
        # partials: [num_tokens, num_heads, NUM_SEGMENTS] (+ HEAD_PAD for the output)
        num_heads = tl.num_programs(1) * group
        part = ((q_start + token) * num_heads + head) * NUM_SEGMENTS + segment
        tl.store(partial_max_ptr + part, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + part, running_sum, mask=row_valid)
        tl.store(partial_out_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=row_valid[:, None])


@triton.jit
def combine_segments_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, sinks_ptr,
    stride_ot, stride_oh,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    RTNE_BF16: tl.constexpr,
):
    """One program per (token, head): merge the split-K partials (log-sum-exp rescaling)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    segments = tl.arange(0, NUM_SEGMENTS)
    base = (token * num_heads + head) * NUM_SEGMENTS
    maxes = tl.load(partial_max_ptr + base + segments)
    sums = tl.load(partial_sum_ptr + base + segments)
    total_max = tl.max(maxes, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        total_max = tl.maximum(total_max, sink)
    weights = tl.exp(maxes - total_max)  # empty segments: exp(-inf) = 0
    total = tl.sum(sums * weights, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - total_max)
    dims = tl.arange(0, HEAD_PAD)
    parts = tl.load(partial_out_ptr + (base + segments)[:, None] * HEAD_PAD + dims[None, :])
    merged = tl.sum(parts * weights[:, None], axis=0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             to_dtype(merged, out_ptr.dtype.element_ty, RTNE_BF16), mask=dims < HEAD)
