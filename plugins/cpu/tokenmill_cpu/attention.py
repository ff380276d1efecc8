"""Paged attention on CPU: the plugin's C++ kernels, with PyTorch's SDPA as the fallback.

Per layer (`forward`) the backend first writes the step's keys/values into the cache
(the C++ `write_kv`, else the reference's `index_copy_`), then attends:

- bf16 with head size 64 or 128 on a CPU with AVX512-BF16 (the default dtype there): one
  call of the C++ `paged_attention_bf16` for every row of the step, prefill chunks and
  decode rows alike, reading keys and values from the paged cache in place (flash-style
  tiles, an online softmax, bf16 dot products; csrc/kernels.cpp);
- otherwise a plan per step and window (cached in `metadata.backend_state` by the first
  layer that needs it) lists which cache blocks each sequence needs (only those inside
  its sliding window) and the masks; every needed block is gathered with one
  `index_select` each for K and V into a buffer that all layers of the step reuse, and:
  - decode rows (query_len 1) go in one call to the C++ decode kernel (float32 or other
    head sizes; no gather); without the kernels, in a few batched SDPA calls, rows
    bucketed by span so padding stays small, with the query heads of one KV head packed
    into SDPA's query-length dimension so grouped-query attention needs no expanded keys;
  - prefill / chunk rows one SDPA call per sequence with a bottom-right causal mask
    (query i of a chunk sits at position seq_len - query_len + i); a fresh prompt
    attends to the step's own keys without a gather.

An FP8 cache (`spec.cache_dtype`, `kv_cache_dtypes`) is written quantized by the
reference's `write_kv`. Its decode rows go to the C++ `decode_attention_fp8`, which reads
the FP8 codes in place (a 256-entry table per format) with the per-KV-head scales folded
into the query and the output: no gather, no dequantized copy. Its prefill rows (and every
row without the kernels) go through the gather path, which dequantizes the blocks into the
compute dtype (stored * scale, per KV head). A fresh prompt's own keys go through the same
rounding, so every row sees the keys exactly as the cache holds them (the reference's
rule).

`CpuPagedAttention.rows_by_path` counts the rows each path attended (`kernel_decode`,
`kernel_paged`, `sdpa_decode`, `sdpa_prefill`), so tests can check that a fast path ran
rather than a fallback; a backend asked for the kernels that could not load them logs it
once when built.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.ops.kv_quant import QUANTIZED_KV_DTYPES, dequantize_kv, quantize_kv
from tokenmill.platforms.ops.reference import check_kv_scales, write_kv
from tokenmill_cpu import kernels

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = frozenset({torch.float32, torch.bfloat16})
# A decode bucket takes rows while their span is at least this fraction of the bucket's
# longest span: at most ~1/4 of a bucket's gathered keys are padding.
_BUCKET_FILL = 0.75


@dataclass(slots=True)
class _DecodeBucket:
    token_ids: torch.Tensor  # int64 [b]: the rows' positions in the step's flat batch
    block_offset: int  # first block of this bucket in the gather buffer
    num_blocks: int  # blocks gathered per row (the bucket's longest span)
    mask: torch.Tensor | None  # bool [b, 1, 1, num_blocks * block_size]; True = attend
    additive_masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class _PrefillSeq:
    query_start: int
    query_end: int
    block_offset: int | None  # None: attend to the step's own keys, nothing cached
    num_blocks: int
    mask: torch.Tensor | None  # bool [query_len, num_keys]; None: plain causal
    additive_masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class _StepPlan:
    gather_block_ids: torch.Tensor  # int64 [total_blocks]
    # int64: slots of the gather buffer (flat over blocks x block_size) at or past their
    # sequence's length (the unwritten tail of a last partial block, a decode row's
    # padding). Zeroed after each gather: the masks hide them, but unwritten memory may
    # hold NaN, and 0 * NaN is NaN.
    stale_slots: torch.Tensor
    decode: list[_DecodeBucket]
    prefill: list[_PrefillSeq]
    # For the C++ decode kernel (then `decode` is empty): the decode rows' query row, int64
    # [d]; their block table rows, int32 [d, max_blocks]; their sequence lengths, int32 [d].
    kernel_decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (dtype, num_kv_heads, head_size) -> [2, total_blocks, block_size, kv heads, head size];
    # the gather buffer, allocated by the first layer and reused by the others.
    buffers: dict[tuple[torch.dtype, int, int], torch.Tensor] = field(default_factory=dict)


class CpuPagedAttention(AttentionBackend):
    """FULL or SLIDING_WINDOW paged attention for fp32/bf16, any block and head size; the
    cache in the compute dtype or FP8 (e4m3, e5m2) with per-head scales."""

    kv_cache_dtypes = QUANTIZED_KV_DTYPES

    def __init__(self, kind: AttentionKind = AttentionKind.FULL, use_kernels: bool = True) -> None:
        if kind not in (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW):
            raise ValueError(f"CpuPagedAttention implements full and sliding window, not {kind}")
        self.kind = kind
        self.name = f"cpu_sdpa_{kind.value}"
        # the C++ decode kernel when built (see tokenmill_cpu.kernels), else SDPA for all rows
        self._kernels = kernels.load() if use_kernels else None
        if use_kernels and self._kernels is None:
            logger.info("tokenmill-cpu: %s runs without the C++ kernels (%s): every row, FP8 "
                        "caches included, goes through the gather and SDPA", self.name,
                        "TOKENMILL_CPU_KERNELS=0" if not kernels.enabled() else "build failed")
        # rows attended per path, for tests and benchmarks to check which one ran
        self.rows_by_path: Counter[str] = Counter()
        # bf16 with head sizes 64 and 128: the kernel for every row (needs AVX512-BF16)
        self._bf16_kernel = self._kernels is not None and self._kernels.has_bf16_dot()

    def supports(self, spec: AttentionSpec) -> bool:
        """Not for attention sinks (gpt-oss): neither the C++ kernels nor SDPA take the
        extra logit, so such layers run on the core's reference attention."""
        windowed = spec.sliding_window is not None
        return (
            not spec.sinks
            and spec.kind == self.kind
            and windowed == (self.kind == AttentionKind.SLIDING_WINDOW)
            and (not windowed or spec.sliding_window > 0)
            and spec.dtype in SUPPORTED_DTYPES
            and (spec.cache_dtype is None or spec.cache_dtype in self.kv_cache_dtypes)
            and spec.num_heads % spec.num_kv_heads == 0
        )

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Resets the step's plans; the first layer that needs one (per window) builds it."""
        metadata.backend_state[self.name] = {}

    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Writes key/value into `kv_cache`, then attends; does not modify the inputs."""
        check_kv_scales(spec, k_scale, v_scale)
        if spec.cache_dtype is not None:
            return self._forward_quantized(spec, query, key, value, kv_cache, metadata,
                                           (k_scale, v_scale))
        if self._kernels is not None and key.dtype == kv_cache.dtype:
            self._kernels.write_kv(key, value, kv_cache, metadata.slot_mapping)
        else:
            write_kv(key, value, kv_cache, metadata.slot_mapping)
        scale = spec.scale if spec.scale is not None else spec.head_size**-0.5
        q = query.to(kv_cache.dtype)
        out = torch.empty_like(q)
        if self._bf16_kernel and q.dtype == torch.bfloat16 and spec.head_size in (64, 128):
            # every row, prefill and decode, read from the cache in place
            self._kernels.paged_attention_bf16(
                q, kv_cache, metadata.block_tables, metadata.seq_lens,
                metadata.query_start_loc, spec.sliding_window or 0, scale, out,
            )
            self.rows_by_path["kernel_paged"] += q.shape[0]
            return out.to(query.dtype)
        plan = self._plan(metadata, spec.sliding_window, self._kernels is not None)
        gathered = _gather(plan, kv_cache)
        if plan.kernel_decode is not None:
            rows, tables, seq_lens = plan.kernel_decode
            window = spec.sliding_window or 0
            self._kernels.decode_attention(q, kv_cache, tables, seq_lens, rows, window, scale, out)
            self.rows_by_path["kernel_decode"] += rows.numel()
        self._sdpa_decode(plan, q, gathered, scale, out)
        own_keys = (key.to(kv_cache.dtype), value.to(kv_cache.dtype)) if plan.prefill else None
        for seq in plan.prefill:
            _prefill(seq, q, own_keys, gathered, scale, out)
            self.rows_by_path["sdpa_prefill"] += seq.query_end - seq.query_start
        return out.to(query.dtype)

    def _forward_quantized(self, spec, query, key, value, kv_cache, metadata, scales):
        """An FP8 cache: written quantized; decode rows read in place by the C++ kernel,
        prefill rows (every row without the kernels) through the dequantizing gather (SDPA
        in the compute dtype)."""
        k_scale, v_scale = scales
        write_kv(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        scale = spec.scale if spec.scale is not None else spec.head_size**-0.5
        q = query.to(spec.dtype)
        out = torch.empty_like(q)
        plan = self._plan(metadata, spec.sliding_window, self._kernels is not None)
        if plan.kernel_decode is not None:
            rows, tables, seq_lens = plan.kernel_decode
            heads = kv_cache.shape[3]
            self._kernels.decode_attention_fp8(
                q, kv_cache, tables, seq_lens, rows, spec.sliding_window or 0, scale,
                _per_kv_head(k_scale, heads), _per_kv_head(v_scale, heads), out,
            )
            self.rows_by_path["kernel_decode"] += rows.numel()
        gathered = _gather(plan, kv_cache, scales, spec.dtype)
        self._sdpa_decode(plan, q, gathered, scale, out)
        own_keys = None
        if plan.prefill:  # the step's own keys as the cache holds them
            own_keys = tuple(
                dequantize_kv(quantize_kv(x, s, kv_cache.dtype), s).to(spec.dtype)
                for x, s in ((key, k_scale), (value, v_scale))
            )
        for seq in plan.prefill:
            _prefill(seq, q, own_keys, gathered, scale, out)
            self.rows_by_path["sdpa_prefill"] += seq.query_end - seq.query_start
        return out.to(query.dtype)

    def _sdpa_decode(self, plan: _StepPlan, q, gathered, scale: float, out) -> None:
        for bucket in plan.decode:
            _decode(bucket, q, gathered, scale, out)
            self.rows_by_path["sdpa_decode"] += bucket.token_ids.numel()

    def _plan(self, metadata: AttentionMetadata, window: int | None, kernel: bool) -> _StepPlan:
        plans = metadata.backend_state.setdefault(self.name, {})
        assert isinstance(plans, dict)
        if (window, kernel) not in plans:
            plans[window, kernel] = _build_plan(metadata, window, kernel)
        return plans[window, kernel]


def _per_kv_head(scale: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """A k/v scale as the C++ kernels take it: contiguous float32 [num_kv_heads] (a
    per-layer scale of one value repeated)."""
    return scale.float().reshape(-1).expand(num_kv_heads).contiguous()


def _gather(
    plan: _StepPlan,
    kv_cache: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """[2, total_blocks, block_size, kv heads, head size]: every block the step reads; an
    FP8 cache's blocks dequantized (`scales`: k_scale, v_scale) into `dtype`."""
    if plan.gather_block_ids.numel() == 0:
        return None
    dtype = dtype or kv_cache.dtype
    key = (dtype, kv_cache.shape[3], kv_cache.shape[4])
    buffer = plan.buffers.get(key)
    if buffer is None:
        shape = (2, plan.gather_block_ids.numel(), *kv_cache.shape[2:])
        buffer = plan.buffers[key] = kv_cache.new_empty(shape, dtype=dtype)
    if scales is None:
        torch.index_select(kv_cache[0], 0, plan.gather_block_ids, out=buffer[0])
        torch.index_select(kv_cache[1], 0, plan.gather_block_ids, out=buffer[1])
    else:
        for half, scale in enumerate(scales):
            stored = kv_cache[half].index_select(0, plan.gather_block_ids)
            buffer[half].copy_(dequantize_kv(stored, scale))
    if plan.stale_slots.numel():
        buffer.flatten(1, 2)[:, plan.stale_slots] = 0
    return buffer


def _decode(
    bucket: _DecodeBucket,
    query: torch.Tensor,
    gathered: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    rows, num_heads, head_size = bucket.token_ids.numel(), query.shape[1], query.shape[2]
    num_kv_heads = gathered.shape[3]
    blocks = gathered[:, bucket.block_offset : bucket.block_offset + rows * bucket.num_blocks]
    # [2, rows, keys, kv heads, D] viewed as [2, rows, kv heads, keys, D] (no copy)
    kv = blocks.reshape(2, rows, -1, num_kv_heads, head_size).transpose(2, 3)
    # the query heads of one KV head play SDPA's query positions: [rows, kv heads, G, D]
    q = query.index_select(0, bucket.token_ids).view(rows, num_kv_heads, -1, head_size)
    mask = _additive_mask(bucket, q.dtype)
    o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=scale)
    out.index_copy_(0, bucket.token_ids, o.reshape(rows, num_heads, head_size))


def _prefill(
    seq: _PrefillSeq,
    query: torch.Tensor,
    own_keys: tuple[torch.Tensor, torch.Tensor],
    gathered: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
) -> None:
    q = query[seq.query_start : seq.query_end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    if seq.block_offset is None:
        k, v = (t[seq.query_start : seq.query_end].transpose(0, 1).unsqueeze(0) for t in own_keys)
    else:
        blocks = gathered[:, seq.block_offset : seq.block_offset + seq.num_blocks]
        kv = blocks.flatten(1, 2).transpose(1, 2).unsqueeze(1)  # [2, 1, kv heads, keys, D]
        k, v = kv[0], kv[1]
    mask = _additive_mask(seq, q.dtype)
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    out[seq.query_start : seq.query_end] = o[0].transpose(0, 1)


def _additive_mask(item: _DecodeBucket | _PrefillSeq, dtype: torch.dtype) -> torch.Tensor | None:
    """The item's mask as 0 / -inf in `dtype`, converted once per step rather than per layer
    (SDPA would convert a boolean mask on every call)."""
    if item.mask is None:
        return None
    if dtype not in item.additive_masks:
        additive = torch.zeros(item.mask.shape, dtype=dtype)
        item.additive_masks[dtype] = additive.masked_fill_(~item.mask, float("-inf"))
    return item.additive_masks[dtype]


def _build_plan(metadata: AttentionMetadata, window: int | None, decode_kernel: bool) -> _StepPlan:
    """Which blocks each sequence reads and with which mask, for one window size; with
    `decode_kernel`, decode rows are left to the C++ kernel, which reads the cache itself."""
    block_size = metadata.block_size
    starts = metadata.query_start_loc.tolist()
    tables = metadata.block_tables.long()
    block_ids: list[torch.Tensor] = []
    stale: list[torch.Tensor] = []
    num_gathered = 0
    decode_rows: list[int] = []
    prefill: list[_PrefillSeq] = []
    for i, (q_len, seq_len) in enumerate(
        zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
    ):
        if q_len == 1:
            decode_rows.append(i)
            continue
        first_pos = 0 if window is None else max(0, seq_len - q_len - window + 1)
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        if q_len == seq_len:  # a fresh prompt: its keys are all in this step
            causal_only = window is None or window >= seq_len
            mask = None if causal_only else _visible(q_pos, q_pos.T, window)
            prefill.append(_PrefillSeq(starts[i], starts[i + 1], None, 0, mask))
            continue
        first_block = first_pos // block_size
        num_blocks = -(-seq_len // block_size) - first_block
        k_pos = (first_block * block_size + torch.arange(num_blocks * block_size)).unsqueeze(0)
        mask = _visible(q_pos, k_pos, window)
        prefill.append(_PrefillSeq(starts[i], starts[i + 1], num_gathered, num_blocks, mask))
        block_ids.append(tables[i, first_block : first_block + num_blocks])
        stale.append(num_gathered * block_size + torch.nonzero(k_pos[0] >= seq_len)[:, 0])
        num_gathered += num_blocks
    kernel_decode = None
    if decode_kernel and decode_rows:
        rows = torch.tensor(decode_rows)
        kernel_decode = (
            torch.tensor([starts[r] for r in decode_rows]),
            metadata.block_tables.index_select(0, rows),
            metadata.seq_lens.index_select(0, rows),
        )
        decode_rows = []
    decode, decode_ids, decode_stale = _decode_buckets(
        metadata, decode_rows, window, starts, num_gathered
    )
    empty = torch.zeros(0, dtype=torch.long)
    gather_ids = torch.cat(block_ids + decode_ids) if block_ids or decode_ids else empty
    stale_slots = torch.cat(stale + decode_stale) if stale or decode_stale else empty
    return _StepPlan(gather_ids, stale_slots, decode, prefill, kernel_decode)


def _decode_buckets(
    metadata: AttentionMetadata,
    rows: list[int],
    window: int | None,
    starts: list[int],
    block_offset: int,
) -> tuple[list[_DecodeBucket], list[torch.Tensor], list[torch.Tensor]]:
    """Decode rows grouped by span (longest first); each group padded to its longest.

    Returns (buckets, block ids to gather, stale gather slots: see `_StepPlan`)."""
    if not rows:
        return [], [], []
    block_size = metadata.block_size
    seq_lens = torch.tensor([metadata.seq_lens_cpu[r] for r in rows])
    first_pos = (seq_lens - window).clamp(min=0) if window is not None else seq_lens * 0
    first_block = first_pos // block_size
    spans = (seq_lens + block_size - 1) // block_size - first_block
    order = torch.argsort(spans, descending=True, stable=True)
    spans_sorted = spans[order].tolist()
    tables = metadata.block_tables.long()
    row_ids = torch.tensor(rows)
    buckets, block_ids, stale = [], [], []
    begin = 0
    while begin < len(rows):
        num_blocks = spans_sorted[begin]
        end = begin + 1
        while end < len(rows) and spans_sorted[end] >= _BUCKET_FILL * num_blocks:
            end += 1
        members = order[begin:end]
        cols = (first_block[members].unsqueeze(1) + torch.arange(num_blocks)).clamp(
            max=tables.shape[1] - 1
        )
        block_ids.append(tables[row_ids[members]].gather(1, cols).flatten())
        k_pos = first_block[members].unsqueeze(1) * block_size + torch.arange(
            num_blocks * block_size
        )
        q_pos = (seq_lens[members] - 1).unsqueeze(1)
        mask = _visible(q_pos, k_pos, window)
        stale.append(block_offset * block_size + torch.nonzero((k_pos > q_pos).flatten())[:, 0])
        token_ids = torch.tensor([starts[r] for r in row_ids[members].tolist()])
        buckets.append(
            _DecodeBucket(
                token_ids=token_ids,
                block_offset=block_offset,
                num_blocks=num_blocks,
                mask=None if bool(mask.all()) else mask[:, None, None, :],
            )
        )
        block_offset += len(members) * num_blocks
        begin = end
    return buckets, block_ids, stale


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """True where a query at q_pos sees a key at k_pos: causal, and within the window."""
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return visible
