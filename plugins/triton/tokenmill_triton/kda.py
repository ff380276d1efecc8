"""Kimi Delta Attention (KDA, Kimi Linear) on Triton: the chunked scan (prefill) and the
recurrence (decode) of the gated delta rule with a per-key-channel decay, for a batch of
sequences of different lengths in one launch each. The causal conv in front is
`tokenmill_triton.gated_delta.causal_conv1d` (the same op).

The references are `tokenmill.ops.kda` (one sequence at a time, float32 math). Shapes as
the Gated DeltaNet kernels except the decay, one per key channel:

    q, k [T, Hk, dk], v [T, Hv, dv], g float32 [T, Hv, dk], beta [T, Hv],
    states float32 [N, Hv, dk, dv] (updated in place)

One program of the scan owns (sequence, value head, a block of value columns) with the
state slice [dk, block_v] in registers across the chunks, as `gated_delta` does. What
differs is the chunk's pairwise decay: exp(gamma_i - gamma_j) is a vector over the key
channels, so the two pair matrices (beta k_i . k_j for the UT transform, q_i . k_j for the
intra-chunk output) are sums over the channels of a [chunk, chunk, channels] product. As
the reference, the decay is taken pairwise, never as exp(gamma_i) * exp(-gamma_j) (the
second factor overflows on fast-decaying channels); the channels go `pair_block_k` at a
time so the 3-d tile stays small. Everything after the pair matrices (the solve, the state
read-out and update) is tl.dot on decays <= 1, as in `gated_delta`. Chunks end at
multiples of chunk_size and at every checkpoint (`gated_delta.chunk_table`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill_triton.configs import KernelConfigs
from tokenmill_triton.gated_delta import chunk_table, last_dim_contiguous, query_starts
from tokenmill_triton.rounding import exact_bf16_casts, to_dtype


@triton.jit
def _row_scale(ptr, rows, row_ok, stride_t, ks, k_ok, L2NORM: tl.constexpr):
    """[CHUNK] float32: what multiplies each row of q or k (one head) to l2-normalise it
    (ones without L2NORM)."""
    scale = (rows * 0).to(tl.float32) + 1.0
    if L2NORM:
        x = tl.load(ptr + rows.to(tl.int64)[:, None] * stride_t + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        scale = tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)
    return scale


@triton.jit
def _rows(ptr, rows, row_ok, stride_t, cols, col_ok):
    """[CHUNK, len(cols)] float32 of a [T, ...] tensor at one head's column offsets."""
    return tl.load(ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :],
                   mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _pair_matrices(q_ptr, k_ptr, g_ptr, rows, ok, stride_qt, stride_kt, stride_gt,
                   q_scale, k_scale, DK: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                   CHUNK: tl.constexpr):
    """(K [i, j] = sum_d k_i[d] k_j[d] exp(gamma_i[d] - gamma_j[d]), the same with q_i for
    k_i) over j <= i, [CHUNK, CHUNK] each; channels BD at a time (gamma's cumsum runs down
    each channel independently, so a block of channels needs only its own g columns)."""
    r = tl.arange(0, CHUNK)
    causal = (r[:, None] >= r[None, :])[:, :, None]
    kk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    qk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for d0 in tl.static_range(0, BK, BD):
        ds = d0 + tl.arange(0, BD)
        d_ok = ds < DK
        q = _rows(q_ptr, rows, ok, stride_qt, ds, d_ok) * q_scale[:, None]
        k = _rows(k_ptr, rows, ok, stride_kt, ds, d_ok) * k_scale[:, None]
        gamma = tl.cumsum(_rows(g_ptr, rows, ok, stride_gt, ds, d_ok), axis=0)
        # gamma falls along a channel, so j <= i has a difference <= 0; capping at 0 keeps
        # the masked j > i finite (no inf computed, then dropped)
        decay = tl.where(causal, tl.exp(tl.minimum(gamma[:, None, :] - gamma[None, :, :], 0.0)),
                         0.0)
        kj = k[None, :, :] * decay
        kk += tl.sum(k[:, None, :] * kj, axis=2)
        qk += tl.sum(q[:, None, :] * kj, axis=2)
    return kk, qk


@triton.jit
def _chunked_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, ckpt_ptr,
    starts_ptr, chunk_starts_ptr, chunk_ends_ptr, chunk_store_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
    stride_bt, stride_ot, stride_oh, num_v_heads, heads_per_k, scale,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BD: tl.constexpr, CHUNK: tl.constexpr, L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, RTNE_BF16: tl.constexpr,
):
    """Program (sequence n, value head h, value block): the chunked scan over the
    sequence's chunks (the host's table), the state slice [DK, BV] in registers."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // heads_per_k
    ks = tl.arange(0, BK)
    k_ok = ks < DK
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    v_ok = vs < DV
    kv_mask = k_ok[:, None] & v_ok[None, :]
    state_off = ((n * num_v_heads + h).to(tl.int64) * DK + ks[:, None]) * DV + vs[None, :]
    s = tl.load(state_ptr + state_off, mask=kv_mask, other=0.0)
    start = tl.load(starts_ptr + n)
    r = tl.arange(0, CHUNK)
    lower = r[:, None] > r[None, :]
    qh_ptr, kh_ptr = q_ptr + hk * stride_qh, k_ptr + hk * stride_kh
    gh_ptr = g_ptr + h * stride_gh
    prev = 0
    for c in range(tl.load(chunk_starts_ptr + n), tl.load(chunk_starts_ptr + n + 1)):
        end = tl.load(chunk_ends_ptr + c)
        count = end - prev
        ok = r < count
        rows = start + prev + r
        q_scale = _row_scale(qh_ptr, rows, ok, stride_qt, ks, k_ok, L2NORM) * scale
        k_scale = _row_scale(kh_ptr, rows, ok, stride_kt, ks, k_ok, L2NORM)
        q = _rows(qh_ptr, rows, ok, stride_qt, ks, k_ok) * q_scale[:, None]
        k = _rows(kh_ptr, rows, ok, stride_kt, ks, k_ok) * k_scale[:, None]
        gamma = tl.cumsum(_rows(gh_ptr, rows, ok, stride_gt, ks, k_ok), axis=0)  # [C, BK]
        v = _rows(v_ptr + h * stride_vh, rows, ok, stride_vt, vs, v_ok)
        beta = tl.load(beta_ptr + rows.to(tl.int64) * stride_bt + h, mask=ok,
                       other=0.0).to(tl.float32)
        kk, intra = _pair_matrices(qh_ptr, kh_ptr, gh_ptr, rows, ok, stride_qt, stride_kt,
                                   stride_gt, q_scale, k_scale, DK, BK, BD, CHUNK)
        a = tl.where(lower, kk * beta[:, None], 0.0)
        # (I + A)^-1 by forward substitution, as gated_delta's scan
        inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
        for i in range(0, CHUNK):
            a_col = tl.sum(tl.where(r[None, :] == i, a, 0.0), axis=1)
            inv_row = tl.sum(tl.where(r[:, None] == i, inv, 0.0), axis=0)
            inv -= a_col[:, None] * inv_row[None, :]
        u = tl.dot(inv, v * beta[:, None], input_precision=DOT_PRECISION)
        w = tl.dot(inv, k * beta[:, None] * tl.exp(gamma), input_precision=DOT_PRECISION)
        v_new = u - tl.dot(w, s, input_precision=DOT_PRECISION)
        o = tl.dot(q * tl.exp(gamma), s, input_precision=DOT_PRECISION) + tl.dot(
            intra, v_new, input_precision=DOT_PRECISION)
        tl.store(out_ptr + h * stride_oh + rows.to(tl.int64)[:, None] * stride_ot + vs[None, :],
                 to_dtype(o, out_ptr.dtype.element_ty, RTNE_BF16),
                 mask=ok[:, None] & v_ok[None, :])
        last = tl.sum(tl.where((r == count - 1)[:, None], gamma, 0.0), axis=0)  # [BK]
        carried = tl.where(ok[:, None], k * tl.exp(last[None, :] - gamma), 0.0)
        s = s * tl.exp(last)[:, None] + tl.dot(tl.trans(carried), v_new,
                                               input_precision=DOT_PRECISION)
        slot = tl.load(chunk_store_ptr + c)
        if slot >= 0:
            ckpt_off = ((slot * num_v_heads + h).to(tl.int64) * DK + ks[:, None]) * DV + vs[None, :]
            tl.store(ckpt_ptr + ckpt_off, s, mask=kv_mask)
        prev = end
    tl.store(state_ptr + state_off, s, mask=kv_mask)


def _check_shapes(q, k, v, g, beta, states, query_lens) -> tuple[int, int, int]:
    """(dk, Hv, dv) after checking every shape against the contract above."""
    num_tokens, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    if q.shape != k.shape or v.shape[0] != num_tokens or num_v_heads % num_k_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k "
                         "must match and the value heads be a multiple of the key heads")
    if g.shape != (num_tokens, num_v_heads, dk) or beta.shape != (num_tokens, num_v_heads):
        raise ValueError(f"KDA's g {tuple(g.shape)} must be [{num_tokens}, {num_v_heads}, "
                         f"{dk}] (one log decay per key channel) and beta {tuple(beta.shape)} "
                         f"[{num_tokens}, {num_v_heads}]")
    if sum(query_lens) != num_tokens:
        raise ValueError(f"query_lens sum to {sum(query_lens)}, not the {num_tokens} tokens")
    want = (len(query_lens), num_v_heads, dk, dv)
    if states.shape != want or states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError(f"states {tuple(states.shape)} {states.dtype} must be contiguous "
                         f"float32 {list(want)}")
    return dk, num_v_heads, dv


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    query_lens: list[int],
    checkpoints: list[list[int]] | None = None,
    use_qk_l2norm: bool = True,
    *,
    configs: KernelConfigs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokenmill.ops.kda.kda_chunked` for every sequence of the step. `states` float32
    [N, Hv, dk, dv]: the state before each sequence's tokens, replaced in place by the state
    after them. `checkpoints[i]`: token counts n in [1, query_lens[i]] after which sequence
    i's state is wanted. Returns (output [T, Hv, dv] in v's dtype, the checkpoint states
    float32 [number of checkpoints, Hv, dk, dv], in order of sequence then n)."""
    dk, num_v_heads, dv = _check_shapes(q, k, v, g, beta, states, query_lens)
    q, k, v, g, beta = last_dim_contiguous(q, k, v, g, beta)
    cfg = configs.linear
    offsets, ends, slots, num_ckpt = chunk_table(query_lens, cfg.chunk_size, checkpoints,
                                                 v.device)
    ckpts = torch.empty((num_ckpt, num_v_heads, dk, dv), dtype=torch.float32, device=v.device)
    out = torch.empty_like(v)
    if not query_lens or v.shape[0] == 0:
        return out, ckpts
    block_k = max(16, triton.next_power_of_2(dk))
    block_v = max(16, min(cfg.block_v, triton.next_power_of_2(dv)))
    grid = (len(query_lens), num_v_heads, triton.cdiv(dv, block_v))
    _chunked_kernel[grid](
        q, k, v, g, beta, out, states, ckpts if num_ckpt else states,
        query_starts(query_lens, v.device), offsets, ends, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), out.stride(0), out.stride(1),
        num_v_heads, num_v_heads // k.shape[1], dk ** -0.5,
        DK=dk, DV=dv, BK=block_k, BV=block_v, BD=min(cfg.pair_block_k, block_k),
        CHUNK=cfg.chunk_size, L2NORM=use_qk_l2norm, DOT_PRECISION=configs.fp32_dot_precision,
        RTNE_BF16=exact_bf16_casts(), num_warps=cfg.num_warps,
    )
    return out, ckpts


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, starts_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
    stride_bt, stride_ot, stride_oh, num_v_heads, heads_per_k, scale,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, RTNE_BF16: tl.constexpr,
):
    """Program (sequence n, value head h, value block): the delta rule token by token, each
    row of the state (a key channel) decaying by its own exp(g)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // heads_per_k
    ks = tl.arange(0, BK)
    k_ok = ks < DK
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    v_ok = vs < DV
    kv_mask = k_ok[:, None] & v_ok[None, :]
    state_off = ((n * num_v_heads + h).to(tl.int64) * DK + ks[:, None]) * DV + vs[None, :]
    s = tl.load(state_ptr + state_off, mask=kv_mask, other=0.0)
    start = tl.load(starts_ptr + n).to(tl.int64)
    for i in range(0, tl.load(starts_ptr + n + 1) - start):
        t64 = start + i
        q = tl.load(q_ptr + t64 * stride_qt + hk * stride_qh + ks, mask=k_ok, other=0.0)
        k = tl.load(k_ptr + t64 * stride_kt + hk * stride_kh + ks, mask=k_ok, other=0.0)
        q, k = q.to(tl.float32), k.to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + vs, mask=v_ok,
                    other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t64 * stride_gt + h * stride_gh + ks, mask=k_ok,
                    other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t64 * stride_bt + h).to(tl.float32)
        s = s * tl.exp(g)[:, None]
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * (q * scale)[:, None], axis=0)
        tl.store(out_ptr + t64 * stride_ot + h * stride_oh + vs,
                 to_dtype(o, out_ptr.dtype.element_ty, RTNE_BF16), mask=v_ok)
    tl.store(state_ptr + state_off, s, mask=kv_mask)


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    query_lens: list[int],
    use_qk_l2norm: bool = True,
    *,
    configs: KernelConfigs,
) -> torch.Tensor:
    """`tokenmill.ops.kda.kda_recurrent` for every sequence of the step (decode: one token
    each), `states` float32 [N, Hv, dk, dv] updated in place. Returns [T, Hv, dv] in v's
    dtype."""
    dk, num_v_heads, dv = _check_shapes(q, k, v, g, beta, states, query_lens)
    q, k, v, g, beta = last_dim_contiguous(q, k, v, g, beta)
    out = torch.empty_like(v)
    if not query_lens or v.shape[0] == 0:
        return out
    cfg = configs.linear
    block_v = min(cfg.block_v, triton.next_power_of_2(dv))
    grid = (len(query_lens), num_v_heads, triton.cdiv(dv, block_v))
    _recurrent_kernel[grid](
        q, k, v, g, beta, out, states, query_starts(query_lens, v.device),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), out.stride(0), out.stride(1),
        num_v_heads, num_v_heads // k.shape[1], dk ** -0.5,
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v, L2NORM=use_qk_l2norm,
        RTNE_BF16=exact_bf16_casts(), num_warps=cfg.num_warps,
    )
    return out
