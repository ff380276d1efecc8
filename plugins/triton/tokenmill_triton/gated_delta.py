"""Gated DeltaNet on Triton: the causal conv1d in front of every recurrent layer of the
package (Gated DeltaNet, KDA and Mamba2 all convolve their inputs first), and Gated
DeltaNet's chunked scan (prefill) and recurrence (decode), which are the gated delta rule
of `tokenmill_triton.delta_rule` with one decay per value head (KDA is the same kernels
with one decay per key channel).

The references are `tokenmill.platforms.ops.gated_delta` (one sequence at a time, float32 math);
every kernel takes the step's tokens flattened ([T, ...], sequence i's tokens at
[start_i, start_i + len_i)) and one dense state per sequence, updated in place:

    conv1d:     x [T, C], weight [C, K], conv states [N, C, K - 1] (the inputs before x)
    chunked:    q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], states f32 [N, Hv, dk, dv]
    recurrent:  the same shapes; one token per step and sequence is its use (decode)
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenmill_triton import delta_rule
from tokenmill_triton.configs import KernelConfigs
from tokenmill_triton.delta_rule import query_starts
from tokenmill_triton.rounding import exact_bf16_casts, to_dtype

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
    """`tokenmill.platforms.ops.gated_delta.causal_conv1d` for every sequence of the step: x [T, C]
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


# ---- the gated delta rule, one decay per head ------------------------------------------

# `tokenmill.platforms.ops.gated_delta.gated_delta_rule_chunked` / `_recurrent` for every
# sequence of the step: the delta-rule kernels with g [T, Hv] (signatures and shapes:
# tokenmill_triton.delta_rule.chunked / .recurrent)
gated_delta_chunked = functools.partial(delta_rule.chunked, per_channel=False)
gated_delta_recurrent = functools.partial(delta_rule.recurrent, per_channel=False)
