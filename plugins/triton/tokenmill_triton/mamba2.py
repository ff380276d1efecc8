"""Mamba2's state-space ops on Triton: the SSD chunked scan (prefill) and the state update
(decode), for a batch of sequences of different lengths in one launch each, with the step
size discretized in-kernel. The causal conv in front is
`tokenmill_triton.gated_delta.causal_conv1d` (the same op, with Mamba2's bias).

The references are `tokenmill.platforms.ops.mamba2` (`mamba2_chunked`, `mamba2_state_update`, and
`discretize_dt`: dt = clamp(softplus(dt_raw + dt_bias), dt_limit)). Here every kernel
takes the step's tokens flattened:

    x [T, H, P], dt_raw [T, H], B and C [T, G, N] (H a multiple of G), A, D, dt_bias [H],
    states float32 [N_seq, H, P, N] (updated in place)

x, B and C may be strided views of the conv's output (no copy). One program of the scan
owns (sequence, head, a block of P rows): the state slice [block_p, N] stays in registers
across the sequence's chunks. Within a chunk the output is the causally masked,
decay-weighted (C B^T)(dt x) plus the carried state read out through C, all tl.dot; the
decay is a scalar per head and token, taken pairwise exp(gamma_i - gamma_j) as the
reference. Chunks end at multiples of chunk_size and at every checkpoint
(`gated_delta.chunk_table`), so the states there come out exact. float32 math; the
output is rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill_triton.configs import KernelConfigs
from tokenmill_triton.delta_rule import chunk_table, query_starts
from tokenmill_triton.rounding import exact_bf16_casts, to_dtype


@triton.jit
def _step_size(dt_raw, dt_bias, dt_min, dt_max):
    """clamp(softplus(dt_raw + dt_bias), dt_min, dt_max) in float32, softplus as torch's
    (the input itself above 20), log1p(e) computed as log(u) * e / (u - 1), u = 1 + e, so
    small steps keep their precision (Triton has no log1p)."""
    z = dt_raw + dt_bias
    e = tl.exp(tl.minimum(z, 20.0))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.minimum(tl.maximum(tl.where(z > 20.0, z, log1p), dt_min), dt_max)


@triton.jit
def _ssd_chunked_kernel(
    x_ptr, dt_ptr, dt_bias_ptr, a_ptr, d_ptr, b_ptr, c_ptr, out_ptr, state_ptr, ckpt_ptr,
    starts_ptr, chunk_starts_ptr, chunk_ends_ptr, chunk_store_ptr,
    stride_xt, stride_xh, stride_dt, stride_bt, stride_bg, stride_ct, stride_cg,
    stride_ot, stride_oh, num_heads, heads_per_group, dt_min, dt_max,
    P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    CHUNK: tl.constexpr, HAS_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    RTNE_BF16: tl.constexpr,
):
    """Program (sequence n, head h, P block): the SSD scan over the sequence's chunks (the
    host's table), the state slice [BP, BN] in registers."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    grp = h // heads_per_group
    ps = tl.program_id(2) * BP + tl.arange(0, BP)
    p_ok = ps < P
    ns = tl.arange(0, BN)
    n_ok = ns < N
    pn_mask = p_ok[:, None] & n_ok[None, :]
    state_off = ((n * num_heads + h).to(tl.int64) * P + ps[:, None]) * N + ns[None, :]
    s = tl.load(state_ptr + state_off, mask=pn_mask, other=0.0)
    a = tl.load(a_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    d = 0.0
    if HAS_D:
        d = tl.load(d_ptr + h).to(tl.float32)
    start = tl.load(starts_ptr + n)
    r = tl.arange(0, CHUNK)
    causal = r[:, None] >= r[None, :]
    prev = 0
    for c in range(tl.load(chunk_starts_ptr + n), tl.load(chunk_starts_ptr + n + 1)):
        end = tl.load(chunk_ends_ptr + c)
        count = end - prev
        ok = r < count
        rows = (start + prev + r).to(tl.int64)
        x = tl.load(x_ptr + h * stride_xh + rows[:, None] * stride_xt + ps[None, :],
                    mask=ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
        bm = tl.load(b_ptr + grp * stride_bg + rows[:, None] * stride_bt + ns[None, :],
                     mask=ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        cm = tl.load(c_ptr + grp * stride_cg + rows[:, None] * stride_ct + ns[None, :],
                     mask=ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        dt_raw = tl.load(dt_ptr + rows * stride_dt + h, mask=ok, other=0.0).to(tl.float32)
        dt = tl.where(ok, _step_size(dt_raw, dt_bias, dt_min, dt_max), 0.0)
        gamma = tl.cumsum(dt * a, axis=0)  # log decay from the chunk start, <= 0
        both = ok[:, None] & ok[None, :]
        pair = tl.where(causal & both, tl.exp(gamma[:, None] - gamma[None, :]), 0.0)
        scores = tl.dot(cm, tl.trans(bm), input_precision=DOT_PRECISION) * pair
        dx = x * dt[:, None]
        y = tl.dot(scores, dx, input_precision=DOT_PRECISION) + tl.dot(
            cm, tl.trans(s), input_precision=DOT_PRECISION) * tl.exp(gamma)[:, None]
        if HAS_D:
            y += d * x
        tl.store(out_ptr + h * stride_oh + rows[:, None] * stride_ot + ps[None, :],
                 to_dtype(y, out_ptr.dtype.element_ty, RTNE_BF16),
                 mask=ok[:, None] & p_ok[None, :])
        last = tl.sum(tl.where(r == count - 1, gamma, 0.0), axis=0)
        carried = tl.where(ok[:, None], dx * tl.exp(last - gamma)[:, None], 0.0)
        s = s * tl.exp(last) + tl.dot(tl.trans(carried), bm, input_precision=DOT_PRECISION)
        slot = tl.load(chunk_store_ptr + c)
        if slot >= 0:
            ckpt_off = ((slot * num_heads + h).to(tl.int64) * P + ps[:, None]) * N + ns[None, :]
            tl.store(ckpt_ptr + ckpt_off, s, mask=pn_mask)
        prev = end
    tl.store(state_ptr + state_off, s, mask=pn_mask)


def _check_shapes(x, dt, A, B, C, D, dt_bias, states, query_lens) -> tuple[int, int, int, int]:
    """(H, P, G, N) after checking every shape against the contract above."""
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    if B.shape != (num_tokens, num_groups, state_size) or C.shape != B.shape:
        raise ValueError(f"B {tuple(B.shape)} and C {tuple(C.shape)} must both be "
                         f"[{num_tokens}, G, N]")
    if num_heads % num_groups:
        raise ValueError(f"{num_heads} heads are not a multiple of {num_groups} B/C groups")
    if dt.shape != (num_tokens, num_heads):
        raise ValueError(f"dt {tuple(dt.shape)} must be [{num_tokens}, {num_heads}]")
    for name, t in (("A", A), ("dt_bias", dt_bias), ("D", D)):
        if t is not None and t.shape != (num_heads,):
            raise ValueError(f"{name} {tuple(t.shape)} must be [{num_heads}]")
    if sum(query_lens) != num_tokens:
        raise ValueError(f"query_lens sum to {sum(query_lens)}, not the {num_tokens} tokens")
    want = (len(query_lens), num_heads, head_dim, state_size)
    if states.shape != want or states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError(f"states {tuple(states.shape)} {states.dtype} must be contiguous "
                         f"float32 {list(want)}")
    for name, t in (("x", x), ("B", B), ("C", C)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dim, got {t.stride()}")
    return num_heads, head_dim, num_groups, state_size


def mamba2_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    query_lens: list[int],
    checkpoints: list[list[int]] | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    *,
    configs: KernelConfigs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`discretize_dt` then `mamba2_chunked` for every sequence of the step: dt is raw
    (before dt_bias and softplus). `states` float32 [N_seq, H, P, N]: the state before each
    sequence's tokens, replaced in place by the state after them. `checkpoints[i]`: token
    counts n in [1, query_lens[i]] after which sequence i's state is wanted. Returns (y
    [T, H, P] in x's dtype, the checkpoint states float32 [number of checkpoints, H, P, N],
    in order of sequence then n)."""
    num_heads, head_dim, num_groups, state_size = _check_shapes(
        x, dt, A, B, C, D, dt_bias, states, query_lens)
    cfg = configs.linear
    offsets, ends, slots, num_ckpt = chunk_table(query_lens, cfg.chunk_size, checkpoints,
                                                 x.device)
    ckpts = torch.empty((num_ckpt, *states.shape[1:]), dtype=torch.float32, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not query_lens or x.shape[0] == 0:
        return out, ckpts
    block_p = max(16, min(cfg.ssd_block_p, triton.next_power_of_2(head_dim)))
    grid = (len(query_lens), num_heads, triton.cdiv(head_dim, block_p))
    dt = dt if dt.stride(-1) == 1 else dt.contiguous()
    _ssd_chunked_kernel[grid](
        x, dt, dt_bias, A, D if D is not None else A, B, C, out, states,
        ckpts if num_ckpt else states, query_starts(query_lens, x.device), offsets, ends, slots,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0),
        C.stride(1), out.stride(0), out.stride(1), num_heads, num_heads // num_groups,
        float(dt_limit[0]), float(dt_limit[1]),
        P=head_dim, N=state_size, BP=block_p, BN=max(16, triton.next_power_of_2(state_size)),
        CHUNK=cfg.chunk_size, HAS_D=D is not None, DOT_PRECISION=configs.fp32_dot_precision,
        RTNE_BF16=exact_bf16_casts(), num_warps=cfg.num_warps,
    )
    return out, ckpts


@triton.jit
def _state_update_kernel(
    x_ptr, dt_ptr, dt_bias_ptr, a_ptr, d_ptr, b_ptr, c_ptr, out_ptr, state_ptr, starts_ptr,
    stride_xt, stride_xh, stride_dt, stride_bt, stride_bg, stride_ct, stride_cg,
    stride_ot, stride_oh, num_heads, heads_per_group, dt_min, dt_max,
    P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_D: tl.constexpr, RTNE_BF16: tl.constexpr,
):
    """Program (sequence n, head h, P block): S <- exp(dt A) S + dt x B^T, y = S C + D x,
    token by token (one token per sequence in a decode step)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    grp = h // heads_per_group
    ps = tl.program_id(2) * BP + tl.arange(0, BP)
    p_ok = ps < P
    ns = tl.arange(0, BN)
    n_ok = ns < N
    pn_mask = p_ok[:, None] & n_ok[None, :]
    state_off = ((n * num_heads + h).to(tl.int64) * P + ps[:, None]) * N + ns[None, :]
    s = tl.load(state_ptr + state_off, mask=pn_mask, other=0.0)
    a = tl.load(a_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    d = 0.0
    if HAS_D:
        d = tl.load(d_ptr + h).to(tl.float32)
    start = tl.load(starts_ptr + n).to(tl.int64)
    for i in range(0, tl.load(starts_ptr + n + 1) - start):
        t64 = start + i
        x = tl.load(x_ptr + t64 * stride_xt + h * stride_xh + ps, mask=p_ok,
                    other=0.0).to(tl.float32)
        bm = tl.load(b_ptr + t64 * stride_bt + grp * stride_bg + ns, mask=n_ok,
                     other=0.0).to(tl.float32)
        cm = tl.load(c_ptr + t64 * stride_ct + grp * stride_cg + ns, mask=n_ok,
                     other=0.0).to(tl.float32)
        dt = _step_size(tl.load(dt_ptr + t64 * stride_dt + h).to(tl.float32), dt_bias,
                        dt_min, dt_max)
        s = s * tl.exp(dt * a) + (x * dt)[:, None] * bm[None, :]
        y = tl.sum(s * cm[None, :], axis=1)
        if HAS_D:
            y += d * x
        tl.store(out_ptr + t64 * stride_ot + h * stride_oh + ps,
                 to_dtype(y, out_ptr.dtype.element_ty, RTNE_BF16), mask=p_ok)
    tl.store(state_ptr + state_off, s, mask=pn_mask)


def mamba2_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    query_lens: list[int],
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    *,
    configs: KernelConfigs,
) -> torch.Tensor:
    """`discretize_dt` then `mamba2_state_update` for every sequence of the step (decode:
    one token each; longer sequences run token by token), `states` float32
    [N_seq, H, P, N] updated in place. Returns y [T, H, P] in x's dtype."""
    num_heads, head_dim, num_groups, state_size = _check_shapes(
        x, dt, A, B, C, D, dt_bias, states, query_lens)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not query_lens or x.shape[0] == 0:
        return out
    block_p = min(configs.linear.ssd_block_p, triton.next_power_of_2(head_dim))
    grid = (len(query_lens), num_heads, triton.cdiv(head_dim, block_p))
    dt = dt if dt.stride(-1) == 1 else dt.contiguous()
    _state_update_kernel[grid](
        x, dt, dt_bias, A, D if D is not None else A, B, C, out, states,
        query_starts(query_lens, x.device),
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0),
        C.stride(1), out.stride(0), out.stride(1), num_heads, num_heads // num_groups,
        float(dt_limit[0]), float(dt_limit[1]),
        P=head_dim, N=state_size, BP=block_p, BN=triton.next_power_of_2(state_size),
        HAS_D=D is not None, RTNE_BF16=exact_bf16_casts(), num_warps=configs.linear.num_warps,
    )
    return out
