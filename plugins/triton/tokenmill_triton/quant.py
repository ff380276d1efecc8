"""Weight-only quantized GEMMs on Triton: y = x @ dequantize(W).T + b, the weight
dequantized tile by tile in registers, never as a whole matrix.

Three weight formats, one kernel (`WEIGHT_FORMAT`):
- int4 in groups (the contract's storage: GGUF Q4_0, Q4_1, Q4_K, AWQ and GPTQ int4):
  w = q * scale + offset per group of `group_size` input columns, q in [0, 16), two codes
  a byte;
- 6- and 8-bit integer codes in groups, one a byte (GGUF Q6_K in groups of 16, Q8_0 in
  groups of 32): the same w = q * scale + offset;
- FP8 e4m3 in row blocks of (1, c) columns (per tensor: one block per row; DeepSeek-V3's
  128 x 128 blocks, which the loader stores as 1 x 128): w = fp8(q) * scale. The codes
  are read as bytes and decoded from their bits in the kernel (sign, 4 exponent bits
  biased by 7, 3 mantissa bits; exponent 0 is subnormal), so the same kernel runs in
  Triton's interpreter, which has no float8 loads, and on GPUs without FP8 units.

Each program computes a BLOCK_M x BLOCK_N tile of y; per step of BLOCK_K input columns it
loads the activations [BLOCK_M, BLOCK_K] and the codes [BLOCK_K, BLOCK_N], dequantizes the
codes in float32 with one scale (and offset) row of the group the step lies in (the host
picks BLOCK_K dividing the group, or a single group spanning every column), rounds them
to x's dtype as the reference does (`dequantize(weight, x.dtype)`), and accumulates
`tl.dot` in float32.

Prepack repacks once, input-major, so a tile's loads run along the output columns:
codes uint8 [in / 2, out] (int4: byte j of column o holds inputs 2j, 2j + 1 in its low and
high nibble, the contract's pairing) or [in, out] (6- and 8-bit codes, FP8 bytes); scales
and offsets float32 [groups, out].
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from tokenmill.platforms.ops.quant import QuantizedWeight, ReferenceQuantizedLinear
from tokenmill_triton.configs import KernelConfigs
from tokenmill_triton.rounding import exact_bf16_casts, to_dtype

logger = logging.getLogger(__name__)

INT4, FP8_E4M3, BYTE_INT = 0, 1, 2  # WEIGHT_FORMAT: packed int4, FP8 e4m3, one code a byte
MIN_BLOCK_K = 16  # tl.dot's smallest inner dimension
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _e4m3_to_float32(code):
    """float32 of float8_e4m3fn codes held as uint8: the value built from the bits
    (exponent field 0 is subnormal, m * 2^-9; 0x7F / 0xFF are NaN; e4m3fn has no inf)."""
    code = code.to(tl.uint32)
    sign = (code >> 7) << 31
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2^-9
    subnormal = tl.where(sign != 0, -subnormal, subnormal)
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _wq_gemm_kernel(
    x_ptr, codes_ptr, scales_ptr, offsets_ptr, bias_ptr, y_ptr,
    m, n, k,
    stride_xm, stride_ym,
    WEIGHT_FORMAT: tl.constexpr,  # INT4, FP8_E4M3 or BYTE_INT
    GROUP: tl.constexpr,  # input columns per scale; BLOCK_K divides it, or it spans k
    HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RTNE_BF16: tl.constexpr,
):
    """y[m, n] = x[m, k] @ W[n, k].T + bias, W dequantized per tile from the repacked
    codes [k / 2 or k, n], scales / offsets [groups, n]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    compute_ty = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        tile_ok = k_ok[:, None] & col_ok[None, :]
        if WEIGHT_FORMAT == 0:
            byte = tl.load(codes_ptr + (ks // 2).to(tl.int64)[:, None] * n + cols[None, :],
                           mask=tile_ok, other=0)
            q = ((byte >> ((ks % 2) * 4).to(tl.uint8)[:, None]) & 0xF).to(tl.float32)
        else:
            byte = tl.load(codes_ptr + ks.to(tl.int64)[:, None] * n + cols[None, :],
                           mask=tile_ok, other=0)
            if WEIGHT_FORMAT == 1:
                q = _e4m3_to_float32(byte)
            else:
                q = byte.to(tl.float32)
        group = k0 // GROUP  # the whole step lies in this group
        scale = tl.load(scales_ptr + group * n + cols, mask=col_ok, other=0.0)
        w = q * scale[None, :]
        if HAS_OFFSETS:
            offset = tl.load(offsets_ptr + group * n + cols, mask=col_ok, other=0.0)
            w = w + offset[None, :]
        w = to_dtype(w, compute_ty, RTNE_BF16)  # the reference's dequantize(weight, x.dtype)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :],
             to_dtype(acc, y_ptr.dtype.element_ty, RTNE_BF16),
             mask=row_ok[:, None] & col_ok[None, :])


def _block_k(group: int, in_features: int, block_k: int) -> int | None:
    """BLOCK_K for a group: the largest power of two up to `block_k` that divides it (so
    no step straddles two groups), any when one group spans every column; None when no
    power of two of at least MIN_BLOCK_K does."""
    if group >= in_features:
        return max(MIN_BLOCK_K, min(block_k, triton.next_power_of_2(in_features)))
    size = block_k
    while size >= MIN_BLOCK_K:
        if group % size == 0:
            return size
        size //= 2
    return None


def kernel_format(weight: QuantizedWeight, block_k: int) -> tuple[int, int] | None:
    """(WEIGHT_FORMAT, BLOCK_K) when the kernel takes `weight`'s scheme, else None: 4-,
    6- and 8-bit integer codes in groups a power of two of at least 16 divides (GGUF's 16
    and 32, AWQ / GPTQ 32/64/128, one group per row), FP8 e4m3 in blocks of one row."""
    scheme = weight.scheme
    if scheme.is_fp8:
        rows, cols = scheme.fp8_block
        if rows != 1 or weight.codes.dtype != torch.float8_e4m3fn:
            return None
        fmt, group = FP8_E4M3, cols
    else:
        fmt, group = (INT4 if scheme.bits == 4 else BYTE_INT), scheme.group_size
    size = _block_k(group, weight.in_features, block_k)
    return None if size is None else (fmt, size)


class TritonQuantizedLinear:
    """y = quantized_linear(x, weight, bias) on `_wq_gemm_kernel`, over codes, scales and
    offsets repacked once (input-major, float32 scales). Owns its copies: later changes to
    `weight` or `bias` do not reach it."""

    kernel = "tokenmill_triton.quant._wq_gemm_kernel"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None,
                 configs: KernelConfigs) -> None:
        found = kernel_format(weight, configs.quant.block_k)
        if found is None:
            raise ValueError(f"the Triton quantized GEMM does not take {weight.scheme}")
        self.weight_format, self.block_k = found
        self.in_features, self.out_features = weight.in_features, weight.out_features
        scheme = weight.scheme
        if scheme.is_fp8:
            self.group = scheme.fp8_block[1]
            codes = weight.codes.view(torch.uint8)
        else:
            self.group = scheme.group_size
            codes = weight.codes
        self.codes = codes.t().contiguous()  # [in / 2, out] for int4, else [in, out]
        self.scales = weight.scales.float().t().contiguous()  # [groups, out]
        self.offsets = (None if weight.offsets is None
                        else weight.offsets.float().t().contiguous())
        self.bias = None if bias is None else bias.detach().clone()
        self.configs = configs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"quantized linear: activations of dtype {x.dtype} are not one "
                             f"of {ACTIVATION_DTYPES}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"quantized linear: x has {x.shape[-1]} features, the weight "
                             f"{self.in_features}")
        flat = x.reshape(-1, self.in_features)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        m, n = flat.shape[0], self.out_features
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m:
            self._launch(flat, y)
        return y.reshape(*x.shape[:-1], n)

    def _launch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        cfg = self.configs.quant
        m, n = y.shape
        block_m = cfg.block_m if m > cfg.small_m else MIN_BLOCK_K
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n))
        bias = self.bias
        _wq_gemm_kernel[grid](
            x, self.codes, self.scales,
            self.offsets if self.offsets is not None else self.scales,
            bias if bias is not None else y, y,
            m, n, self.in_features, x.stride(0), y.stride(0),
            WEIGHT_FORMAT=self.weight_format, GROUP=self.group,
            HAS_OFFSETS=self.offsets is not None, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=self.block_k,
            UPCAST=self.configs.upcast_bf16_dot and x.dtype == torch.bfloat16,
            DOT_PRECISION=self.configs.fp32_dot_precision, RTNE_BF16=exact_bf16_casts(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


def prepack_quantized_linear(
    weight: QuantizedWeight, bias: torch.Tensor | None, *,
    configs: KernelConfigs, fallback: ReferenceQuantizedLinear,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The core's op of that name: integer codes in groups and FP8 e4m3 in row blocks on
    `_wq_gemm_kernel` (`kernel_format` says which); any other scheme (a group no power of
    two >= 16 divides, FP8 blocks of several rows) goes to `fallback`, the core's
    reference, which logs once per scheme."""
    if kernel_format(weight, configs.quant.block_k) is not None:
        return TritonQuantizedLinear(weight, bias, configs)
    return fallback(weight, bias)
