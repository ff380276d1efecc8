"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi) on Triton, over the paged
latent cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim].

Every row of a step (decodes and prefill chunks alike, in one launch) runs the absorbed
form of `tokenmill.platforms.ops.mla`: W_UK is folded into the query on the host (one batched GEMM,
q_lat[h] = W_UK[h]^T q_nope[h]), the kernel attends (q_lat | q_pe) against the cached
(c_kv | k_pe) rows with an online softmax and returns the latent output sum_k p_k c_kv[k],
and W_UV is applied after (another batched GEMM). One program owns one query token, a
block of heads and a block of the latent output's columns: every head of the token shares
each latent tile it reads, which is what makes MLA decode cheap (one latent row per key
instead of per-head keys and values). At rank 512 a whole latent row of output per head
does not fit in registers (sm_90 spilled 46 KB per thread, see
docs/certificates/*-compile.md), so the output's columns go `block_r` per program and the
scores take the row `block_k` columns at a time; each program recomputes the scores of its
keys (cheap next to reading them: decode is bound by memory, and the tiles hit cache).
Prefill rows use the same form (exact, as the reference's decompressed one); a
decompressed prefill through the ragged attention kernel would read the cache less often
per query row and is left for when a GPU can measure it. Math in float32: the latent
tiles are converted on load (as the interpreter's bf16 tl.dot needs anyway), scores and
the softmax are float32, the output is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.ops.kv_quant import QUANTIZED_KV_DTYPES
from tokenmill.platforms.ops.mla import write_latent
from tokenmill_triton.configs import KernelConfigs

SUPPORTED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


@triton.jit
def _mla_kernel(
    q_ptr, cache_ptr, out_ptr, tables_ptr, token_seq_ptr, starts_ptr, seq_lens_ptr,
    k_scale_ptr,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_tb, stride_ot, stride_oh,
    num_heads, scale,
    RANK: tl.constexpr, ROPE: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,  # an FP8 latent cache: rows read as stored * k_scale[0]
):
    """Program (token t, head block, latent block): o_lat[t, h, block] = softmax(scale *
    (q_lat . c_kv + q_pe . k_pe)) @ c_kv[:, block] over the keys token t sees causally.
    The scores take the whole latent row, BLOCK_K columns at a time (q_lat re-read from
    cache each tile), so registers hold [BLOCK_H, BLOCK_R] of output whatever the rank."""
    t = tl.program_id(0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < num_heads
    rs = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rs < RANK
    n = tl.load(token_seq_ptr + t)
    q_start = tl.load(starts_ptr + n)
    q_len = tl.load(starts_ptr + n + 1) - q_start
    visible = tl.load(seq_lens_ptr + n) - q_len + (t - q_start) + 1
    ck = tl.arange(0, BLOCK_K)
    pr = tl.arange(0, ROPE_PAD)
    pr_ok = pr < ROPE
    q_row = q_ptr + t.to(tl.int64) * stride_qt + hs[:, None] * stride_qh
    q_pe = tl.load(q_row + RANK + pr[None, :], mask=h_ok[:, None] & pr_ok[None, :],
                   other=0.0).to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, visible, TILE_N):
        ks = k0 + tl.arange(0, TILE_N)
        k_ok = ks < visible
        block = tl.load(tables_ptr + n.to(tl.int64) * stride_tb + ks // PAGE, mask=k_ok, other=0)
        rows = cache_ptr + block.to(tl.int64) * stride_cb + (ks % PAGE) * stride_cs
        pe = tl.load(rows[:, None] + RANK + pr[None, :], mask=k_ok[:, None] & pr_ok[None, :],
                     other=0.0).to(tl.float32)
        if QUANTIZED:
            pe = pe * tl.load(k_scale_ptr)
        s = tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
        for c0 in tl.static_range(0, RANK_PAD, BLOCK_K):
            c_ok = (c0 + ck) < RANK
            q_lat = tl.load(q_row + c0 + ck[None, :], mask=h_ok[:, None] & c_ok[None, :],
                            other=0.0).to(tl.float32)
            c = tl.load(rows[:, None] + c0 + ck[None, :], mask=k_ok[:, None] & c_ok[None, :],
                        other=0.0).to(tl.float32)
            if QUANTIZED:
                c = c * tl.load(k_scale_ptr)
            s += tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.where(k_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(rows[:, None] + rs[None, :], mask=k_ok[:, None] & r_ok[None, :],
                    other=0.0).to(tl.float32)
        if QUANTIZED:
            v = v * tl.load(k_scale_ptr)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m = m_new
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + hs[:, None] * stride_oh + rs[None, :],
             acc / denom[:, None], mask=h_ok[:, None] & r_ok[None, :])


def latent_attention(
    q_abs: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    token_seq: torch.Tensor,
    rank: int,
    scale: float,
    configs: KernelConfigs,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """o_lat float32 [T, H, rank] for q_abs [T, H, rank + rope] (q_lat | q_pe) over the paged
    latent cache; `token_seq` int32 [T]: each token's sequence in the metadata. An FP8
    cache's rows are read as stored * `k_scale` (float32 [1])."""
    num_tokens, num_heads, width = q_abs.shape
    rope = width - rank
    out = torch.empty((num_tokens, num_heads, rank), dtype=torch.float32, device=q_abs.device)
    if num_tokens == 0:
        return out
    if kv_cache.stride(-1) != 1 or kv_cache.shape[-1] != width:
        raise ValueError(f"latent cache {tuple(kv_cache.shape)} must be contiguous rows of "
                         f"{width} values")
    cfg = configs.mla
    block_h = max(16, min(cfg.block_h, triton.next_power_of_2(num_heads)))
    rank_pad = max(16, triton.next_power_of_2(rank))
    block_r = min(cfg.block_r, rank_pad)
    grid = (num_tokens, triton.cdiv(num_heads, block_h), triton.cdiv(rank, block_r))
    tables = metadata.block_tables
    _mla_kernel[grid](
        q_abs, kv_cache, out, tables, token_seq, metadata.query_start_loc, metadata.seq_lens,
        k_scale if k_scale is not None else out,
        q_abs.stride(0), q_abs.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        tables.stride(0), out.stride(0), out.stride(1), num_heads, scale,
        RANK=rank, ROPE=rope, RANK_PAD=rank_pad,
        ROPE_PAD=max(16, triton.next_power_of_2(max(rope, 1))), PAGE=kv_cache.shape[1],
        BLOCK_H=block_h, TILE_N=cfg.tile_n, BLOCK_R=block_r,
        BLOCK_K=min(cfg.block_k, rank_pad), DOT_PRECISION=configs.fp32_dot_precision,
        QUANTIZED=k_scale is not None, num_warps=cfg.num_warps,
    )
    return out


class TritonMLAAttention(AttentionBackend):
    """The MLA kind on the standard latent cache: any rank, rope and block size; the cache
    in the compute dtype or FP8 (one scale per layer)."""

    kind = AttentionKind.MLA
    kv_cache_dtypes = QUANTIZED_KV_DTYPES

    def __init__(self, configs: KernelConfigs, platform_name: str) -> None:
        self.configs = configs
        self.name = f"{platform_name}_triton_mla"

    def supports(self, spec: AttentionSpec) -> bool:
        return (
            spec.kind == AttentionKind.MLA and spec.dtype in SUPPORTED_DTYPES
            and (spec.cache_dtype is None or spec.cache_dtype in self.kv_cache_dtypes)
        )

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Drops the previous step's token map; the step's first layer builds the new one."""
        metadata.backend_state.pop(self.name, None)

    def _token_seq(self, metadata: AttentionMetadata) -> torch.Tensor:
        """Each token's sequence (int32 [T]), once per step for every MLA layer."""
        token_seq = metadata.backend_state.get(self.name)
        if token_seq is None:
            lens = torch.tensor(metadata.query_lens_cpu, dtype=torch.int64)
            token_seq = torch.repeat_interleave(torch.arange(len(lens)), lens).to(torch.int32)
            token_seq = metadata.backend_state[self.name] = token_seq.to(
                metadata.query_start_loc.device)
        return token_seq

    def forward(self, spec, query, key, value, kv_cache, metadata, *, w_uk, w_uv,
                k_scale=None, v_scale=None):
        """See `AttentionBackend.forward` (MLA) and `tokenmill.platforms.ops.mla.mla_attention`
        (an FP8 latent cache: `k_scale` float32 [1]; `v_scale` unused)."""
        if value is not None:
            raise ValueError("MLA has no separate value: pass value=None (values come from c_kv)")
        if (k_scale is not None) != (spec.cache_dtype is not None):
            raise ValueError(f"spec.cache_dtype={spec.cache_dtype} but k_scale={k_scale}: a "
                             "quantized latent cache takes k_scale, any other none")
        if k_scale is not None:
            k_scale = k_scale.to(device=kv_cache.device, dtype=torch.float32).contiguous()
        dims = spec.mla
        rank, nope = dims.kv_lora_rank, dims.qk_nope_head_dim
        write_latent(key, kv_cache, metadata.slot_mapping, k_scale)
        scale = spec.scale if spec.scale is not None else dims.qk_head_dim**-0.5
        q = query.float()
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk.float()).transpose(0, 1)
        q_abs = torch.cat((q_lat, q[..., nope:]), dim=-1).contiguous()  # [T, H, rank + rope]
        o_lat = latent_attention(q_abs, kv_cache, metadata, self._token_seq(metadata),
                                 rank, scale, self.configs, k_scale)
        out = torch.bmm(o_lat.transpose(0, 1), w_uv.float().transpose(1, 2)).transpose(0, 1)
        return out.to(query.dtype)
