"""The gated delta rule on Triton, for Gated DeltaNet (Qwen3-Next: one decay per value
head and token) and Kimi Delta Attention (KDA, Kimi Linear: one decay per key channel):
one chunked scan (prefill) and one recurrence (decode), each a single kernel with a
per-channel-gate switch, for a batch of sequences of different lengths in one launch.

The references are `tokenmill.platforms.ops.gated_delta` and `tokenmill.platforms.ops.kda` (one sequence at a
time, float32 math). Every kernel takes the step's tokens flattened ([T, ...], sequence
i's tokens at [start_i, start_i + len_i)) and one dense state per sequence, updated in
place:

    q, k [T, Hk, dk], v [T, Hv, dv], beta [T, Hv], states float32 [N, Hv, dk, dv]
    g float32 [T, Hv] (Gated DeltaNet) or [T, Hv, dk] (KDA: PER_CHANNEL)

One program of the scan owns (sequence, value head, a block of value columns): the state
slice [dk, block_v] stays in registers across the sequence's chunks. Within a chunk the
delta updates are condensed as the references do (the UT transform): (I + A)^-1 comes from
forward substitution over the chunk's rows, then everything is tl.dot on decays <= 1. The
switch changes only the chunk's pairwise decays: with one decay per head, exp(gamma_i -
gamma_j) scales the whole pair matrices k_i . k_j and q_i . k_j (two tl.dot); per key
channel, it weighs each channel, so the pair matrices are sums over the channels of a
[chunk, chunk, channels] product, `pair_block_k` channels at a time, the decay taken
pairwise (exp(gamma_i) * exp(-gamma_j) would overflow on fast-decaying channels). Chunks
end at multiples of chunk_size and at every checkpoint (`gated_delta.chunk_table`), so
the state after any token a prefix-cache checkpoint wants is stored exactly. q and k are
l2-normalised in the kernel, as the references; outputs are rounded once to v's dtype.

The recurrence reads the decay through strides: a per-head decay is read with a key-channel
stride of 0, so both models run the same code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill_triton.configs import KernelConfigs
from tokenmill_triton.rounding import exact_bf16_casts, to_dtype


def query_starts(query_lens: list[int], device) -> torch.Tensor:
    """int32 [N + 1]: where each sequence's tokens start in the step, then the total."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def chunk_table(query_lens: list[int], chunk_size: int,
                checkpoints: list[list[int]] | None, device):
    """(chunk offsets per sequence [N + 1], chunk ends [M] (query-relative), checkpoint slot
    of each chunk [M] (-1: none), the number of checkpoints): ends at multiples of
    chunk_size and at each checkpoint. Shared by every chunked scan of the package."""
    offsets, ends, slots = [0], [], []
    slot = 0
    for i, length in enumerate(query_lens):
        wanted = sorted(set(checkpoints[i])) if checkpoints else []
        if any(not 0 < p <= length for p in wanted):
            raise ValueError(f"checkpoints {wanted} of sequence {i} are not in [1, {length}]")
        cuts = sorted(set(range(chunk_size, length, chunk_size)) | set(wanted) | {length})
        for cut in cuts if length else []:
            ends.append(cut)
            if cut in wanted:
                slots.append(slot)
                slot += 1
            else:
                slots.append(-1)
        offsets.append(len(ends))
    as_tensor = lambda xs: torch.tensor(xs or [0], dtype=torch.int32, device=device)  # noqa: E731
    return as_tensor(offsets), as_tensor(ends), as_tensor(slots), slot


def last_dim_contiguous(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The tensors with a unit stride in their last dim (the kernels' column loads)."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


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
def _channel_pairs(q_ptr, k_ptr, g_ptr, rows, ok, stride_qt, stride_kt, stride_gt,
                   q_scale, k_scale, DK: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                   CHUNK: tl.constexpr):
    """Per-channel decays: (K [i, j] = sum_d k_i[d] k_j[d] exp(gamma_i[d] - gamma_j[d]), the
    same with q_i for k_i) over j <= i, [CHUNK, CHUNK] each; channels BD at a time (gamma's
    cumsum runs down each channel independently, so a block of channels needs only its own
    g columns)."""
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
    BD: tl.constexpr, CHUNK: tl.constexpr, PER_CHANNEL: tl.constexpr, L2NORM: tl.constexpr,
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
        v = _rows(v_ptr + h * stride_vh, rows, ok, stride_vt, vs, v_ok)
        beta = tl.load(beta_ptr + rows.to(tl.int64) * stride_bt + h, mask=ok,
                       other=0.0).to(tl.float32)
        if PER_CHANNEL:  # gamma [CHUNK, BK]: each key channel decays on its own
            gamma = tl.cumsum(_rows(gh_ptr, rows, ok, stride_gt, ks, k_ok), axis=0)
            kk, intra = _channel_pairs(qh_ptr, kh_ptr, gh_ptr, rows, ok, stride_qt,
                                       stride_kt, stride_gt, q_scale, k_scale, DK, BK, BD,
                                       CHUNK)
            decay = tl.exp(gamma)  # from the chunk start, per row and channel
            last = tl.sum(tl.where((r == count - 1)[:, None], gamma, 0.0), axis=0)  # [BK]
            carried = tl.where(ok[:, None], k * tl.exp(last[None, :] - gamma), 0.0)
            state_decay = tl.exp(last)[:, None]
        else:  # gamma [CHUNK]: one decay per head scales whole rows
            g = tl.load(gh_ptr + rows.to(tl.int64) * stride_gt, mask=ok, other=0.0)
            gamma = tl.cumsum(g.to(tl.float32), axis=0)
            both = ok[:, None] & ok[None, :]
            pair = tl.where((r[:, None] >= r[None, :]) & both,
                            tl.exp(gamma[:, None] - gamma[None, :]), 0.0)
            kk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION) * pair
            intra = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * pair
            decay = tl.exp(gamma)[:, None]
            last = tl.sum(tl.where(r == count - 1, gamma, 0.0), axis=0)
            carried = tl.where(ok[:, None], k * tl.exp(last - gamma)[:, None], 0.0)
            state_decay = tl.exp(last)
        a = tl.where(lower, kk * beta[:, None], 0.0)
        # (I + A)^-1 by forward substitution: once row i is final, take A[:, i] x row i
        # from every row below (A is strictly lower, so rows <= i lose nothing)
        inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
        for i in range(0, CHUNK):
            a_col = tl.sum(tl.where(r[None, :] == i, a, 0.0), axis=1)
            inv_row = tl.sum(tl.where(r[:, None] == i, inv, 0.0), axis=0)
            inv -= a_col[:, None] * inv_row[None, :]
        u = tl.dot(inv, v * beta[:, None], input_precision=DOT_PRECISION)
        w = tl.dot(inv, k * beta[:, None] * decay, input_precision=DOT_PRECISION)
        v_new = u - tl.dot(w, s, input_precision=DOT_PRECISION)
        o = tl.dot(q * decay, s, input_precision=DOT_PRECISION) + tl.dot(
            intra, v_new, input_precision=DOT_PRECISION)
        tl.store(out_ptr + h * stride_oh + rows.to(tl.int64)[:, None] * stride_ot + vs[None, :],
                 to_dtype(o, out_ptr.dtype.element_ty, RTNE_BF16),
                 mask=ok[:, None] & v_ok[None, :])
        s = s * state_decay + tl.dot(tl.trans(carried), v_new, input_precision=DOT_PRECISION)
        slot = tl.load(chunk_store_ptr + c)
        if slot >= 0:
            ckpt_off = ((slot * num_v_heads + h).to(tl.int64) * DK + ks[:, None]) * DV + vs[None, :]
            tl.store(ckpt_ptr + ckpt_off, s, mask=kv_mask)
        prev = end
    tl.store(state_ptr + state_off, s, mask=kv_mask)


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, starts_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
    stride_gk, stride_bt, stride_ot, stride_oh, num_v_heads, heads_per_k, scale,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, RTNE_BF16: tl.constexpr,
):
    """Program (sequence n, value head h, value block): the delta rule token by token, each
    row of the state (a key channel) decaying by its exp(g) (stride_gk 0: one per head)."""
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
        g = tl.load(g_ptr + t64 * stride_gt + h * stride_gh + ks * stride_gk, mask=k_ok,
                    other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t64 * stride_bt + h).to(tl.float32)
        s = s * tl.exp(g)[:, None]
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * (q * scale)[:, None], axis=0)
        tl.store(out_ptr + t64 * stride_ot + h * stride_oh + vs,
                 to_dtype(o, out_ptr.dtype.element_ty, RTNE_BF16), mask=v_ok)
    tl.store(state_ptr + state_off, s, mask=kv_mask)


def check_shapes(q, k, v, g, beta, states, query_lens, per_channel: bool) -> tuple[int, int, int]:
    """(dk, Hv, dv) after checking every shape against the module's contract."""
    num_tokens, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    if q.shape != k.shape or v.shape[0] != num_tokens or num_v_heads % num_k_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k "
                         "must match and the value heads be a multiple of the key heads")
    want_g = (num_tokens, num_v_heads, dk) if per_channel else (num_tokens, num_v_heads)
    if g.shape != want_g or beta.shape != (num_tokens, num_v_heads):
        what = "one log decay per key channel" if per_channel else "one log decay per head"
        raise ValueError(f"g {tuple(g.shape)} must be {list(want_g)} ({what}) and beta "
                         f"{tuple(beta.shape)} [{num_tokens}, {num_v_heads}]")
    if sum(query_lens) != num_tokens:
        raise ValueError(f"query_lens sum to {sum(query_lens)}, not the {num_tokens} tokens")
    want = (len(query_lens), num_v_heads, dk, dv)
    if states.shape != want or states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError(f"states {tuple(states.shape)} {states.dtype} must be contiguous "
                         f"float32 {list(want)}")
    return dk, num_v_heads, dv


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, states: torch.Tensor, query_lens: list[int],
            checkpoints: list[list[int]] | None = None, use_qk_l2norm: bool = True, *,
            per_channel: bool, configs: KernelConfigs) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan for every sequence of the step (shapes: module docstring). `states`
    is replaced in place by the state after each sequence's tokens; `checkpoints[i]`: token
    counts n in [1, query_lens[i]] after which sequence i's state is wanted. Returns (output
    [T, Hv, dv] in v's dtype, checkpoint states float32 [number, Hv, dk, dv], in order of
    sequence then n)."""
    dk, num_v_heads, dv = check_shapes(q, k, v, g, beta, states, query_lens, per_channel)
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
        CHUNK=cfg.chunk_size, PER_CHANNEL=per_channel, L2NORM=use_qk_l2norm,
        DOT_PRECISION=configs.fp32_dot_precision, RTNE_BF16=exact_bf16_casts(),
        num_warps=cfg.num_warps,
    )
    return out, ckpts


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, states: torch.Tensor, query_lens: list[int],
              use_qk_l2norm: bool = True, *, per_channel: bool,
              configs: KernelConfigs) -> torch.Tensor:
    """The recurrence for every sequence of the step (decode: one token each), `states`
    updated in place. Returns [T, Hv, dv] in v's dtype."""
    dk, num_v_heads, dv = check_shapes(q, k, v, g, beta, states, query_lens, per_channel)
    q, k, v, g, beta = last_dim_contiguous(q, k, v, g, beta)
    out = torch.empty_like(v)
    if not query_lens or v.shape[0] == 0:
        return out
    block_v = min(configs.linear.block_v, triton.next_power_of_2(dv))
    grid = (len(query_lens), num_v_heads, triton.cdiv(dv, block_v))
    _recurrent_kernel[grid](
        q, k, v, g, beta, out, states, query_starts(query_lens, v.device),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), g.stride(2) if per_channel else 0, beta.stride(0),
        out.stride(0), out.stride(1), num_v_heads, num_v_heads // k.shape[1], dk ** -0.5,
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v, L2NORM=use_qk_l2norm,
        RTNE_BF16=exact_bf16_casts(), num_warps=configs.linear.num_warps,
    )
    return out
