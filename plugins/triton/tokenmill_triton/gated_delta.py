"""Gated DeltaNet on Triton: the causal conv1d, the chunked scan (prefill) and the
recurrence (decode), for a batch of sequences of different lengths in one launch each.

The references are `tokenmill.ops.gated_delta` (one sequence at a time, float32 math);
here every kernel takes the step's tokens flattened ([T, ...], sequence i's tokens at
[start_i, start_i + len_i)) and one dense state per sequence, updated in place:

    conv1d:     x [T, C], weight [C, K], conv states [N, C, K - 1] (the inputs before x)
    chunked:    q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], states f32 [N, Hv, dk, dv]
    recurrent:  the same shapes; one token per step and sequence is its use (decode)

One program of the scan owns (sequence, value head, a block of value columns): the state
slice [dk, block_v] stays in registers across the sequence's chunks, so states cross
chunk boundaries without leaving the chip. Within a chunk the delta updates are condensed
as the reference does (the UT transform): (I + A)^-1 comes from forward substitution over
the chunk's rows, then everything is tl.dot. Chunks are given by the host as a table of
ends per sequence: multiples of chunk_size from the query start plus any checkpoint
position, so the state after any token a prefix-cache checkpoint wants is stored exactly
(`checkpoints=` below) at no extra pass. All math is float32 (q, k l2-normalised in the
kernel, as the reference); outputs are rounded once to v's dtype.
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


# ---- causal conv1d ---------------------------------------------------------------------

@triton.jit
def _conv1d_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, starts_ptr, channels,
    stride_x, stride_o, stride_sn, stride_sc,
    WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, RTNE_BF16: tl.constexpr,
):
    """Program (sequence n, channel block): out[t] = act(sum_j w[:, j] x_ext[t + j] + b), x_ext
    = the K - 1 state inputs then x; the state becomes the last K - 1 inputs."""
    n = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cs < channels
    start = tl.load(starts_ptr + n)
    length = tl.load(starts_ptr + n + 1) - start
    state_base = state_ptr + n.to(tl.int64) * stride_sn + cs.to(tl.int64) * stride_sc
    w_dtype = w_ptr.dtype.element_ty
    for t0 in range(0, length, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        t_ok = ts < length
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            pos = ts - (WIDTH - 1) + j  # index into x; negative: the state's inputs
            from_x = t_ok & (pos >= 0)
            from_state = t_ok & (pos < 0)
            xv = tl.load(x_ptr + (start + pos).to(tl.int64)[:, None] * stride_x + cs[None, :],
                         mask=from_x[:, None] & c_ok[None, :], other=0.0)
            sv = tl.load(state_base[None, :] + (WIDTH - 1 + pos)[:, None],
                         mask=from_state[:, None] & c_ok[None, :], other=0.0)
            # the reference convolves in the weights' dtype: its inputs are cast to it
            xj = to_dtype(xv, w_dtype, RTNE_BF16).to(tl.float32) + \
                to_dtype(sv.to(x_ptr.dtype.element_ty), w_dtype, RTNE_BF16).to(tl.float32)
            wj = tl.load(w_ptr + cs * WIDTH + j, mask=c_ok, other=0.0).to(tl.float32)
            acc += xj * wj[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cs, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        y = to_dtype(acc, w_dtype, RTNE_BF16).to(tl.float32)
        if SILU:
            y = to_dtype(y / (1.0 + tl.exp(-y)), w_dtype, RTNE_BF16).to(tl.float32)
        tl.store(out_ptr + (start + ts).to(tl.int64)[:, None] * stride_o + cs[None, :],
                 to_dtype(y, out_ptr.dtype.element_ty, RTNE_BF16),
                 mask=t_ok[:, None] & c_ok[None, :])
    # the new state: the last K - 1 inputs, all loaded before any is overwritten
    i = tl.arange(0, WIDTH_PAD)
    i_ok = i < WIDTH - 1
    pos = length - (WIDTH - 1) + i
    xv = tl.load(x_ptr + (start + pos).to(tl.int64)[:, None] * stride_x + cs[None, :],
                 mask=(i_ok & (pos >= 0))[:, None] & c_ok[None, :], other=0.0)
    sv = tl.load(state_base[None, :] + (WIDTH - 1 + pos)[:, None],
                 mask=(i_ok & (pos < 0))[:, None] & c_ok[None, :], other=0.0)
    new = xv.to(tl.float32) + sv.to(tl.float32)
    tl.debug_barrier()
    tl.store(state_base[None, :] + i[:, None], new.to(state_ptr.dtype.element_ty),
             mask=i_ok[:, None] & c_ok[None, :])


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    query_lens: list[int],
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    *,
    configs: KernelConfigs,
) -> torch.Tensor:
    """`tokenmill.ops.gated_delta.causal_conv1d` for every sequence of the step: x [T, C]
    (sequence i's tokens at the offsets of `query_lens`), weight [C, K], states [N, C, K - 1]
    in x's dtype (zeros for a fresh sequence), updated in place to each sequence's last
    K - 1 inputs. Returns the output [T, C] in x's dtype."""
    if activation not in ("silu", None):
        raise ValueError(f"activation {activation!r} is not one of ('silu', None)")
    channels, width = weight.shape
    if states.shape != (len(query_lens), channels, width - 1) or states.stride(-1) != 1:
        raise ValueError(f"conv states {tuple(states.shape)} must be contiguous "
                         f"[{len(query_lens)}, {channels}, {width - 1}]")
    x = x.contiguous()
    out = torch.empty_like(x)
    if not query_lens:
        return out
    cfg = configs.linear
    block_c = min(cfg.conv_block_c, triton.next_power_of_2(channels))
    grid = (len(query_lens), triton.cdiv(channels, block_c))
    _conv1d_kernel[grid](
        x, weight.contiguous(), bias if bias is not None else x, states, out,
        query_starts(query_lens, x.device), channels,
        x.stride(0), out.stride(0), states.stride(0), states.stride(1),
        WIDTH=width, WIDTH_PAD=triton.next_power_of_2(max(width - 1, 1)),
        HAS_BIAS=bias is not None, SILU=activation == "silu",
        BLOCK_C=block_c, BLOCK_T=cfg.conv_block_t, RTNE_BF16=exact_bf16_casts(),
        num_warps=cfg.num_warps,
    )
    return out


# ---- the gated delta rule --------------------------------------------------------------

@triton.jit
def _load_qk(ptr, rows, row_ok, stride_t, ks, k_ok, L2NORM: tl.constexpr):
    """[CHUNK, BK] float32 rows of q or k (one head), l2-normalised as the reference."""
    x = tl.load(ptr + rows.to(tl.int64)[:, None] * stride_t + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _chunked_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, ckpt_ptr,
    starts_ptr, chunk_starts_ptr, chunk_ends_ptr, chunk_store_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_ot, stride_oh, num_v_heads, heads_per_k, scale,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    CHUNK: tl.constexpr, L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    RTNE_BF16: tl.constexpr,
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
    causal = r[:, None] >= r[None, :]
    prev = 0
    for c in range(tl.load(chunk_starts_ptr + n), tl.load(chunk_starts_ptr + n + 1)):
        end = tl.load(chunk_ends_ptr + c)
        count = end - prev
        ok = r < count
        rows = start + prev + r
        q = _load_qk(q_ptr + hk * stride_qh, rows, ok, stride_qt, ks, k_ok, L2NORM) * scale
        k = _load_qk(k_ptr + hk * stride_kh, rows, ok, stride_kt, ks, k_ok, L2NORM)
        v = tl.load(v_ptr + h * stride_vh + rows.to(tl.int64)[:, None] * stride_vt
                    + vs[None, :], mask=ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows.to(tl.int64) * stride_gt + h, mask=ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows.to(tl.int64) * stride_bt + h, mask=ok,
                       other=0.0).to(tl.float32)
        gamma = tl.cumsum(g, axis=0)  # log decay from the chunk start
        both = ok[:, None] & ok[None, :]
        pair = tl.where(causal & both, tl.exp(gamma[:, None] - gamma[None, :]), 0.0)
        kb = k * beta[:, None]
        a = tl.where(lower, tl.dot(kb, tl.trans(k), input_precision=DOT_PRECISION) * pair, 0.0)
        # (I + A)^-1 by forward substitution: once row i is final, take A[:, i] x row i
        # from every row below (A is strictly lower, so rows <= i lose nothing)
        inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
        for i in range(0, CHUNK):
            a_col = tl.sum(tl.where(r[None, :] == i, a, 0.0), axis=1)
            inv_row = tl.sum(tl.where(r[:, None] == i, inv, 0.0), axis=0)
            inv -= a_col[:, None] * inv_row[None, :]
        u = tl.dot(inv, v * beta[:, None], input_precision=DOT_PRECISION)
        w = tl.dot(inv, kb * tl.exp(gamma)[:, None], input_precision=DOT_PRECISION)
        v_new = u - tl.dot(w, s, input_precision=DOT_PRECISION)
        intra = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * pair
        o = tl.dot(q * tl.exp(gamma)[:, None], s, input_precision=DOT_PRECISION) + tl.dot(
            intra, v_new, input_precision=DOT_PRECISION)
        tl.store(out_ptr + h * stride_oh + rows.to(tl.int64)[:, None] * stride_ot + vs[None, :],
                 to_dtype(o, out_ptr.dtype.element_ty, RTNE_BF16),
                 mask=ok[:, None] & v_ok[None, :])
        last = tl.sum(tl.where(r == count - 1, gamma, 0.0), axis=0)
        carried = tl.where(ok[:, None], k * tl.exp(last - gamma)[:, None], 0.0)
        s = s * tl.exp(last) + tl.dot(tl.trans(carried), v_new, input_precision=DOT_PRECISION)
        slot = tl.load(chunk_store_ptr + c)
        if slot >= 0:
            ckpt_off = ((slot * num_v_heads + h).to(tl.int64) * DK + ks[:, None]) * DV + vs[None, :]
            tl.store(ckpt_ptr + ckpt_off, s, mask=kv_mask)
        prev = end
    tl.store(state_ptr + state_off, s, mask=kv_mask)


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


def _check_shapes(q, k, v, g, beta, states, query_lens) -> tuple[int, int, int, int, int]:
    num_tokens, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    if q.shape != k.shape or v.shape[0] != num_tokens or num_v_heads % num_k_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k "
                         "must match and the value heads be a multiple of the key heads")
    if g.shape != (num_tokens, num_v_heads) or beta.shape != g.shape:
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be "
                         f"[{num_tokens}, {num_v_heads}]")
    if sum(query_lens) != num_tokens:
        raise ValueError(f"query_lens sum to {sum(query_lens)}, not the {num_tokens} tokens")
    want = (len(query_lens), num_v_heads, dk, dv)
    if states.shape != want or states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError(f"states {tuple(states.shape)} {states.dtype} must be contiguous "
                         f"float32 {list(want)}")
    return num_tokens, num_k_heads, dk, num_v_heads, dv


def last_dim_contiguous(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The tensors with a unit stride in their last dim (the kernels' column loads)."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def gated_delta_chunked(
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
    """`gated_delta_rule_chunked` for every sequence of the step. `states` float32
    [N, Hv, dk, dv]: the state before each sequence's tokens, replaced in place by the
    state after them. `checkpoints[i]`: token counts n in [1, query_lens[i]] after which
    sequence i's state is wanted. Returns (output [T, Hv, dv] in v's dtype, the
    checkpoint states float32 [number of checkpoints, Hv, dk, dv], in order of sequence
    then n)."""
    _, _, dk, num_v_heads, dv = _check_shapes(q, k, v, g, beta, states, query_lens)
    q, k, v, g, beta = last_dim_contiguous(q, k, v, g, beta)
    cfg = configs.linear
    chunk_size = cfg.chunk_size
    offsets, ends, slots, num_ckpt = chunk_table(query_lens, chunk_size, checkpoints, v.device)
    ckpts = torch.empty((num_ckpt, num_v_heads, dk, dv), dtype=torch.float32, device=v.device)
    out = torch.empty_like(v)
    if not query_lens or v.shape[0] == 0:
        return out, ckpts
    block_v = max(16, min(cfg.block_v, triton.next_power_of_2(dv)))
    grid = (len(query_lens), num_v_heads, triton.cdiv(dv, block_v))
    _chunked_kernel[grid](
        q, k, v, g, beta, out, states, ckpts if num_ckpt else states,
        query_starts(query_lens, v.device), offsets, ends, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        num_v_heads, num_v_heads // k.shape[1], dk ** -0.5,
        DK=dk, DV=dv, BK=max(16, triton.next_power_of_2(dk)), BV=block_v, CHUNK=chunk_size,
        L2NORM=use_qk_l2norm, DOT_PRECISION=configs.fp32_dot_precision,
        RTNE_BF16=exact_bf16_casts(), num_warps=cfg.num_warps,
    )
    return out, ckpts


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, starts_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_ot, stride_oh, num_v_heads, heads_per_k, scale,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, RTNE_BF16: tl.constexpr,
):
    """Program (sequence n, value head h, value block): the delta rule token by token."""
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
        g = tl.load(g_ptr + t64 * stride_gt + h).to(tl.float32)
        beta = tl.load(beta_ptr + t64 * stride_bt + h).to(tl.float32)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * (q * scale)[:, None], axis=0)
        tl.store(out_ptr + t64 * stride_ot + h * stride_oh + vs,
                 to_dtype(o, out_ptr.dtype.element_ty, RTNE_BF16), mask=v_ok)
    tl.store(state_ptr + state_off, s, mask=kv_mask)


def gated_delta_recurrent(
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
    """`gated_delta_rule_recurrent` for every sequence of the step (decode: one token
    each), `states` float32 [N, Hv, dk, dv] updated in place. Returns [T, Hv, dv] in v's
    dtype."""
    _, _, dk, num_v_heads, dv = _check_shapes(q, k, v, g, beta, states, query_lens)
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
        g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        num_v_heads, num_v_heads // k.shape[1], dk ** -0.5,
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v, L2NORM=use_qk_l2norm,
        RTNE_BF16=exact_bf16_casts(), num_warps=cfg.num_warps,
    )
    return out
