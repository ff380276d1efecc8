"""Row-wise Triton kernels: RMSNorm, fused add + RMSNorm, rotary, SiLU-and-mul, the token
bitmask. Each wrapper has the signature and the rounding of its reference in
`tokenmill.platforms.ops.reference` (math in float32, rounded where the reference rounds), and
takes the plugin's `ElementwiseConfig`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill_triton.configs import ElementwiseConfig
from tokenmill_triton.rounding import exact_bf16_casts, to_dtype


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr,
    stride_x, stride_r, stride_o, stride_s, n_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program: several when rows are short
    BLOCK: tl.constexpr,
    RTNE: tl.constexpr,  # bf16 casts rounded to nearest even (the interpreter truncates)
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows * stride_r + cols, mask=mask, other=0.0)
        x = to_dtype(x.to(tl.float32) + r.to(tl.float32), summed_ptr.dtype.element_ty, RTNE)
        tl.store(summed_ptr + rows * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=1) / n_cols + eps)
    # the reference rounds the normalised row to the input dtype, then multiplies by weight
    normed = to_dtype(x32 * rstd[:, None], x_ptr.dtype.element_ty, RTNE).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_o + cols, to_dtype(normed * w, out_ptr.dtype.element_ty, RTNE),
             mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, config: ElementwiseConfig
) -> torch.Tensor:
    """reference.rms_norm: x / sqrt(mean(x^2) + eps) * weight, float32 math."""
    return _rms_norm(x, None, weight, eps, config)[0]


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    config: ElementwiseConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.fused_add_rms_norm: (rms_norm(x + residual), x + residual); one pass,
    inputs unmodified."""
    return _rms_norm(x, residual, weight, eps, config)


def _rms_norm(x, residual, weight, eps, config):
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    summed = res = None
    if residual is not None:
        res = residual.reshape(-1, hidden).contiguous()
        summed = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, residual.dtype),
                             device=x.device)
    n_rows = rows.shape[0]
    if n_rows:
        block = triton.next_power_of_2(hidden)
        per_program = min(triton.next_power_of_2(n_rows), max(1, config.block_n // block))
        _rms_norm_kernel[(triton.cdiv(n_rows, per_program),)](
            rows, res if res is not None else rows, weight.contiguous(), out,
            summed if summed is not None else out,
            rows.stride(0), res.stride(0) if res is not None else 0, out.stride(0),
            summed.stride(0) if summed is not None else 0, n_rows, hidden, eps,
            HAS_RESIDUAL=residual is not None,
            ROWS=per_program,
            BLOCK=block,
            RTNE=exact_bf16_casts(),
            num_warps=config.num_warps,
        )
    out = out.view(x.shape)
    return out, (summed.view(x.shape) if summed is not None else None)


@triton.jit
def _rotary_kernel(
    positions_ptr, x_ptr, out_ptr, cos_sin_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cache, num_tokens, num_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    TOKENS: tl.constexpr,  # tokens per program
    RTNE: tl.constexpr,  # bf16 casts rounded to nearest even (the interpreter truncates)
):
    """Rotate-half on the first 2 * HALF dims of every head of TOKENS tokens; copy the rest.
    Tiles are [TOKENS, HEADS_PAD, HALF_PAD]."""
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    token_ok = tokens < num_tokens
    pos = tl.load(positions_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
    t = tokens.to(tl.int64)[:, None, None]
    heads = tl.arange(0, HEADS_PAD)[None, :, None]
    half = tl.arange(0, HALF_PAD)[None, None, :]
    head_ok = token_ok[:, None, None] & (heads < num_heads)
    rot_mask = head_ok & (half < HALF)
    cache_row = cos_sin_ptr + pos[:, None, None] * stride_cache + half
    cache_mask = token_ok[:, None, None] & (half < HALF)
    cos = tl.load(cache_row, mask=cache_mask, other=0.0)
    sin = tl.load(cache_row + HALF, mask=cache_mask, other=0.0)
    x_row = x_ptr + t * stride_xt + heads * stride_xh
    o_row = out_ptr + t * stride_ot + heads * stride_oh
    x1 = tl.load(x_row + half, mask=rot_mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + half, mask=rot_mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(o_row + half, to_dtype(x1 * cos - x2 * sin, dtype, RTNE), mask=rot_mask)
    tl.store(o_row + HALF + half, to_dtype(x2 * cos + x1 * sin, dtype, RTNE), mask=rot_mask)
    if 2 * HALF < HEAD:  # the dims past rotary_dim are copied unchanged
        rest = tl.arange(0, HEAD_PAD)[None, None, :]
        rest_mask = head_ok & (rest >= 2 * HALF) & (rest < HEAD)
        tl.store(o_row + rest, tl.load(x_row + rest, mask=rest_mask), mask=rest_mask)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    config: ElementwiseConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rotary_embedding (neox rotate-half on the first rotary_dim of each head);
    returns new tensors, inputs unmodified."""
    rotary_dim = cos_sin_cache.shape[-1]
    cache = cos_sin_cache if cos_sin_cache.dtype == torch.float32 else cos_sin_cache.float()
    cache = cache.contiguous()
    return tuple(_rotate(positions, x, cache, rotary_dim // 2, config) for x in (query, key))


def _rotate(positions, x, cache, half, config):
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    num_tokens, num_heads, head = x.shape
    if num_tokens:
        heads_pad, head_pad = triton.next_power_of_2(num_heads), triton.next_power_of_2(head)
        per_program = min(triton.next_power_of_2(num_tokens),
                          max(1, config.block_n // (heads_pad * head_pad)))
        _rotary_kernel[(triton.cdiv(num_tokens, per_program),)](
            positions, x, out, cache,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cache.stride(0),
            num_tokens, num_heads,
            HALF=half, HALF_PAD=triton.next_power_of_2(half), HEAD=head, HEAD_PAD=head_pad,
            HEADS_PAD=heads_pad, TOKENS=per_program, RTNE=exact_bf16_casts(),
            num_warps=config.num_warps,
        )
    return out


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_rows, d, alpha, limit,
                        ACTIVATION: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                        RTNE: tl.constexpr):
    """out = act(gate) * up for x = (gate | up); rounded as torch rounds each op in the
    activations' dtype. ACTIVATION: "silu", "gelu_tanh" or "swiglu_oai" (gpt-oss:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit))."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (rows < n_rows) & (cols < d)
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + rows * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "silu":
        act = to_dtype(gate / (1.0 + tl.exp(-gate)), dtype, RTNE).to(tl.float32)
    elif ACTIVATION == "gelu_tanh":
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        act = to_dtype(0.5 * gate * (1.0 + tanh), dtype, RTNE).to(tl.float32)
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        scaled = to_dtype(gate * alpha, dtype, RTNE).to(tl.float32)
        sig = to_dtype(1.0 / (1.0 + tl.exp(-scaled)), dtype, RTNE).to(tl.float32)
        act = to_dtype(gate * sig, dtype, RTNE).to(tl.float32)
        up = to_dtype(up + 1.0, dtype, RTNE).to(tl.float32)
    tl.store(out_ptr + rows * stride_o + cols, to_dtype(act * up, dtype, RTNE), mask=mask)


def silu_and_mul(x: torch.Tensor, config: ElementwiseConfig) -> torch.Tensor:
    """reference.silu_and_mul: x is [..., 2 * d] holding (gate | up); returns silu(gate) * up."""
    return act_and_mul(x, config, "silu")


def gelu_tanh_and_mul(x: torch.Tensor, config: ElementwiseConfig) -> torch.Tensor:
    """reference.gelu_tanh_and_mul: gelu_tanh(gate) * up (Gemma's MLP)."""
    return act_and_mul(x, config, "gelu_tanh")


def act_and_mul(x: torch.Tensor, config: ElementwiseConfig, activation: str,
                alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """act(gate) * up for x = [..., 2 * d] (gate | up); `activation` as in the kernel."""
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    n_rows = rows.shape[0]
    if n_rows:
        block = min(config.block_n, triton.next_power_of_2(d))
        per_program = min(triton.next_power_of_2(n_rows), max(1, config.block_n // block))
        grid = (triton.cdiv(n_rows, per_program), triton.cdiv(d, block))
        _act_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), n_rows, d, alpha,
                                  limit, ACTIVATION=activation, ROWS=per_program, BLOCK=block,
                                  RTNE=exact_bf16_casts(), num_warps=config.num_warps)
    return out.view(*x.shape[:-1], d)


@triton.jit
def _token_bitmask_kernel(
    logits_ptr, bitmask_ptr, rows_ptr, stride_logits, stride_mask, vocab, num_words,
    BLOCK: tl.constexpr,
):
    """Program (j, c): mask row j's columns [c * BLOCK, (c + 1) * BLOCK) of logits row rows[j]."""
    j = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + j)
    in_vocab = cols < vocab
    word_index = cols // 32
    has_word = in_vocab & (word_index < num_words)
    words = tl.load(bitmask_ptr + j * stride_mask + word_index, mask=has_word, other=0)
    allowed = has_word & (((words >> (cols % 32)) & 1) != 0)
    neg_inf = tl.full([BLOCK], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + cols, neg_inf, mask=in_vocab & ~allowed)


def apply_token_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    row_indices: torch.Tensor,
    config: ElementwiseConfig,
) -> None:
    """reference.apply_token_bitmask: in place, -inf where a row's grammar forbids a token;
    only the forbidden entries are written."""
    num = row_indices.numel()
    if num == 0:
        return
    if logits.stride(-1) != 1:
        raise ValueError(f"logits must be contiguous in the vocab dimension, got {logits.stride()}")
    mask = bitmask.contiguous()
    vocab = logits.shape[1]
    block = min(config.block_n, triton.next_power_of_2(vocab))
    _token_bitmask_kernel[(num, triton.cdiv(vocab, block))](
        logits, mask, row_indices.to(logits.device), logits.stride(0), mask.stride(0), vocab,
        mask.shape[1], BLOCK=block, num_warps=config.num_warps,
    )
