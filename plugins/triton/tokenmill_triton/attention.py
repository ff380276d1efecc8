"""Ragged paged attention on Triton: the launcher and the `AttentionBackend` both plugins use.

`paged_attention` runs one layer of one step in one launch (two with split-K); the
backend writes the step's keys/values with `write_kv`, then attends. Launch settings come
from the plugin's `KernelConfigs`.
"""

from __future__ import annotations

import torch
import triton

from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.ops.kv_quant import QUANTIZED_KV_DTYPES, is_quantized
from tokenmill.platforms.ops.reference import check_kv_scales
from tokenmill_triton.attention_kernels import (
    combine_segments_kernel,
    paged_attention_kernel,
    write_kv_kernel,
)
from tokenmill_triton.configs import KernelConfigs
from tokenmill_triton.rounding import exact_bf16_casts

SUPPORTED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
# an FP8 cache dtype -> (mantissa bits, smallest normal exponent, exponent bias), how the
# KV write encodes it (tokenmill_triton.rounding.fp8_bits)
FP8_FORMATS = {torch.float8_e4m3fn: (3, -6, 7), torch.float8_e5m2: (2, -14, 15)}
MIN_HEAD_SIZE, MAX_HEAD_SIZE = 16, 256  # tl.dot needs K >= 16; 256 bounds the tile in SRAM


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    configs: KernelConfigs,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """`tokenmill.platforms.ops.reference.write_kv` in one launch; slots < 0 (padding) are
    skipped. An FP8 cache stores x / scale per KV head (float32 `k_scale` / `v_scale`)."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    _check_rows(key, "key")
    _check_rows(value, "value")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's last dimension must be contiguous")
    head_pad = triton.next_power_of_2(head_size)
    cfg = configs.elementwise
    block_c = min(triton.next_power_of_2(num_kv_heads) * head_pad, max(head_pad, cfg.block_n))
    block_t = max(1, cfg.block_n // block_c)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_kv_heads * head_pad, block_c))
    quantized = is_quantized(kv_cache.dtype)
    fmt = FP8_FORMATS.get(kv_cache.dtype, (0, 0, 0))
    write_kv_kernel[grid](
        key, value, kv_cache.view(torch.uint8) if quantized else kv_cache, slot_mapping,
        k_scale if quantized else slot_mapping, v_scale if quantized else slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_tokens, num_kv_heads, kv_cache.shape[2],
        HEAD=head_size,
        HEAD_PAD=head_pad,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        QUANTIZED=quantized,
        FP8_MAX=torch.finfo(kv_cache.dtype).max if quantized else 0.0,
        FP8_MANT=fmt[0], FP8_MIN_EXP=fmt[1], FP8_BIAS=fmt[2],
        num_warps=cfg.num_warps,
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    scale: float,
    configs: KernelConfigs,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # float [num_heads]: one extra softmax logit per head
    num_segments: int | None = None,  # None: the config's choice for this step
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an FP8 cache's k / v scales
) -> torch.Tensor:
    """Causal attention of every query row to its sequence's cached keys (written already).

    A query at position p sees keys in (p - sliding_window, p]. Returns a new tensor
    shaped and typed like `query`; reads `kv_cache` only. An FP8 cache (`kv_scales`: float32
    [num_kv_heads] each) is read as stored * scale, in the query's dtype."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    _check_rows(query, "query")
    cfg = configs.attention
    decode_only = metadata.max_query_len == 1
    if num_segments is None:
        # a captured graph replays for every context length later: split whenever capturing
        long_enough = metadata.max_seq_len >= cfg.split_k_min_seq_len or _capturing(query)
        num_segments = cfg.num_segments if decode_only and long_enough else 1
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = cfg.decode_block_m if decode_only else cfg.block_m
    if query.dtype == torch.float32 and not decode_only and cfg.float32_block_m:
        block_m = min(block_m, cfg.float32_block_m)
    block_q = max(1, block_m // group_pad)
    head_pad = triton.next_power_of_2(head_size)
    tile_n = cfg.decode_tile_n if decode_only else cfg.tile_n
    tile_elements = cfg.tile_elements
    if query.dtype == torch.float32 and cfg.float32_tile_elements:
        tile_elements = min(tile_elements, cfg.float32_tile_elements)
    tile_n = min(tile_n, max(16, tile_elements // head_pad))
    num_seqs = metadata.num_seqs
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    dtype = query.dtype
    if num_segments > 1:
        parts = (num_tokens, num_heads, num_segments)
        partial_max = torch.empty(parts, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty(parts, dtype=torch.float32, device=query.device)
        partial_out = torch.empty((*parts, head_pad), dtype=torch.float32, device=query.device)
    else:
        partial_max = partial_sum = partial_out = out  # unused
    paged_attention_kernel[grid](
        query, out, kv_cache, metadata.block_tables, metadata.seq_lens,
        metadata.query_start_loc, sinks if sinks is not None else out,
        partial_out, partial_max, partial_sum,
        *(kv_scales if kv_scales is not None else (out, out)),
        scale, num_seqs, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        metadata.block_tables.stride(0), kv_cache.shape[2], group,
        BLOCK_Q=block_q,
        GROUP_PAD=group_pad,
        HEAD=head_size,
        HEAD_PAD=head_pad,
        TILE_N=tile_n,
        HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        NUM_SEGMENTS=num_segments,
        UPCAST=configs.upcast_bf16_dot and dtype == torch.bfloat16,
        DOT_PRECISION=configs.fp32_dot_precision,  # applies to float32 tiles only
        RTNE_BF16=exact_bf16_casts(),
        QUANTIZED=kv_scales is not None,
        num_warps=cfg.decode_num_warps if decode_only else cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_segments > 1:
        combine_segments_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_max, partial_sum, sinks if sinks is not None else out,
            out.stride(0), out.stride(1),
            HEAD=head_size, HEAD_PAD=head_pad, NUM_SEGMENTS=num_segments,
            HAS_SINKS=sinks is not None, RTNE_BF16=exact_bf16_casts(),
            num_warps=configs.elementwise.num_warps,
        )
    return out


def _capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA / HIP graph is being captured on the current stream."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got {x.stride()}")


class TritonPagedAttention(AttentionBackend):
    """FULL or SLIDING_WINDOW paged attention for float32/float16/bfloat16 on Triton; the
    cache in the compute dtype or FP8 (e4m3, e5m2) with per-KV-head scales.

    `configs` are the calling plugin's launch settings; `name_prefix` names the backend
    after the plugin ("nvidia_triton_full")."""

    kv_cache_dtypes = QUANTIZED_KV_DTYPES

    def __init__(self, kind: AttentionKind, configs: KernelConfigs, name_prefix: str) -> None:
        if kind not in (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW):
            raise ValueError(f"TritonPagedAttention implements full and sliding window, not {kind}")
        self.kind = kind
        self.name = f"{name_prefix}_triton_{kind.value}"
        self.configs = configs

    def supports(self, spec: AttentionSpec) -> bool:
        windowed = spec.sliding_window is not None
        return (
            spec.kind == self.kind
            and windowed == (self.kind == AttentionKind.SLIDING_WINDOW)
            and (not windowed or spec.sliding_window > 0)
            and spec.dtype in SUPPORTED_DTYPES
            and (spec.cache_dtype is None or spec.cache_dtype in self.kv_cache_dtypes)
            and MIN_HEAD_SIZE <= spec.head_size <= MAX_HEAD_SIZE
            and spec.num_heads % spec.num_kv_heads == 0
        )  # sinks (spec.sinks) are a kernel argument: supported either way

    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Writes key/value into `kv_cache`, then attends; does not modify the inputs.
        `sinks`: float32 [num_heads] learned logits, given exactly when `spec.sinks`;
        `k_scale` / `v_scale`: float32 [num_kv_heads], exactly for an FP8 cache."""
        if (sinks is not None) != spec.sinks:
            raise ValueError(f"spec.sinks={spec.sinks} but sinks {'not ' * (sinks is None)}given")
        check_kv_scales(spec, k_scale, v_scale)
        scales = None
        if k_scale is not None:
            scales = tuple(s.to(device=kv_cache.device, dtype=torch.float32).contiguous()
                           for s in (k_scale, v_scale))
        write_kv(key, value, kv_cache, metadata.slot_mapping, self.configs,
                 *(scales or (None, None)))
        scale = spec.scale if spec.scale is not None else spec.head_size**-0.5
        q = query if query.dtype == spec.dtype else query.to(spec.dtype)
        if sinks is not None:
            sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
        out = paged_attention(q, kv_cache, metadata, scale, self.configs, spec.sliding_window,
                              sinks, kv_scales=scales)
        return out if out.dtype == query.dtype else out.to(query.dtype)
