"""CPU overrides of the core's reference ops.

Two implementations of each: the fused C++ kernels of `tokenmill_cpu.kernels` when they are
built (one call per op, the big win at batch 1), and ATen compositions otherwise.
`kernel_ops()` picks once per process.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.platforms.ops import reference
from tokenmill.platforms.ops.quant import (
    QuantizedWeight,
    ReferenceQuantizedLinear,
    quantized_linear,
    unpacked_codes,
)
from tokenmill_cpu import kernels

logger = logging.getLogger(__name__)

# oneDNN's own blocked weight layout streams weights about 1.3-2x faster than F.linear's
# MKL path at small batch (measured on torch 2.13, 2 cores: a 3072x576 bf16 matmul at
# batch 1 went from 12 to 21 GB/s; fp32 from 10 to 19 GB/s).
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_linear_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


# At or below this many rows a bf16 linear is a weight-streaming GEMV: the kernels' AVX512-BF16
# GEMV beats oneDNN there (SmolLM2's 121 matmuls per batch-1 step, 2 threads: ~8.9 ms at
# ~30 GB/s against oneDNN's ~12.5 ms); above it oneDNN's blocked GEMM wins.
_GEMV_MAX_ROWS = 4


def prepack_linear(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Repack `weight` for oneDNN once; the returned function computes x @ W.T + b (through the
    kernels' GEMV for a few rows of bf16, when built)."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES:
        return lambda x: F.linear(x, weight, bias)
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return lambda x: F.linear(x, weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    bias = None if bias is None else bias.detach()
    linear_pointwise = torch.ops.mkldnn._linear_pointwise

    def apply(x: torch.Tensor) -> torch.Tensor:
        return linear_pointwise(x, packed, bias, "none", [], "")

    k = kernels.load()
    in_features = weight.shape[1]
    if (
        k is None
        or weight.dtype != torch.bfloat16
        or not k.has_bf16_dot()
        or in_features % 32
    ):
        return apply
    natural = weight.detach().contiguous()
    linear_bf16 = k.linear_bf16

    def apply_small_m(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= _GEMV_MAX_ROWS and x.dim() == 2 and x.dtype == torch.bfloat16:
            return linear_bf16(x, natural, bias)
        return linear_pointwise(x, packed, bias, "none", [], "")

    return apply_small_m


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One fused ATen kernel instead of the reference's eight ops (~38 us -> ~8 us per call
    at hidden 576); accumulates in float32 like the reference."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return F.rms_norm(summed, (summed.shape[-1],), weight, eps), summed


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary in the activations' dtype (as transformers computes it), with the cos/sin
    rows gathered once for query and key."""
    rotary_dim = cos_sin_cache.shape[-1]
    half = rotary_dim // 2
    cos_sin = cos_sin_cache.index_select(0, positions).to(query.dtype).unsqueeze(1)
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]

    def apply(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if rotary_dim == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)

    return apply(query), apply(key)


def kernel_ops() -> dict[str, Callable]:
    """The fused C++ versions of the element-wise ops, or {} when the kernels are not built.

    Each is one call where the ATen version is 3-10 kernels; same signatures and rounding as
    the core's references (the conformance suite checks them against those)."""
    k = kernels.load()
    if k is None:
        return {}
    return {
        "rms_norm": k.rms_norm,
        "fused_add_rms_norm": k.fused_add_rms_norm,  # returns (out, summed), as the reference
        "rotary_embedding": k.rotary_embedding,  # returns (query, key)
        "silu_and_mul": k.silu_and_mul,
    }


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor
) -> None:
    """The reference's contract. numpy's unpackbits expands the words' bytes (little-endian:
    LSB first) straight into one bool per token, and the rows are masked in place instead
    of gathered and scattered back: 1.7-2.8x faster than the reference at batch 1 and 16,
    vocab 49152 (docs/benchmarks.md, "Structured output")."""
    num = row_indices.numel()
    if num == 0:
        return
    if logits.device.type != "cpu" or sys.byteorder != "little":
        return reference.apply_token_bitmask(logits, bitmask, row_indices)
    vocab = logits.shape[1]
    words = bitmask.contiguous().numpy().view(np.uint8)
    bits = np.unpackbits(words, axis=1, bitorder="little")
    width = min(vocab, bits.shape[1])
    disallowed = torch.from_numpy(bits[:, :width].view(np.bool_)).logical_not()
    rows = row_indices.tolist()
    first = rows[0]
    if rows == list(range(first, first + num)):
        logits[first : first + num, :width].masked_fill_(disallowed, float("-inf"))
    else:
        for j, row in enumerate(rows):
            logits[row, :width].masked_fill_(disallowed[j], float("-inf"))
    if width < vocab:
        logits[row_indices, width:] = float("-inf")


# torch's CPU int4 weight-only kernel takes these group sizes (measured at batch 1 on this
# machine: a 1536x576 layer in 214 us against 423 us for bf16 F.linear; docs/quantization.md)
_INT4_GROUPS = (32, 64, 128, 256)

# Many rows of x through a quantized layer: its weight written out in x's dtype, a block
# of rows at a time, into one scratch buffer per thread and dtype (a fresh tensor per call
# paid for its pages: 3.5 MB of float32 per call cost more than the GEMM), then a dense
# GEMM per block. A block is what fits in `_SCRATCH_BYTES` (SmolLM2's projections whole,
# its 49152-row head in 7-14 blocks).
_SCRATCH_BYTES = 8 << 20
_scratch = threading.local()


def _scratch_rows(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    buf = getattr(_scratch, str(dtype), None)
    if buf is None or buf.numel() < rows * cols:
        buf = torch.empty(rows * cols, dtype=dtype)
        setattr(_scratch, str(dtype), buf)
    return buf[: rows * cols].view(rows, cols)


def linear_written_out(
    x: torch.Tensor, write: Callable[[torch.Tensor, int, int], None], out_features: int,
    bias: torch.Tensor | None, scratch_bytes: int = _SCRATCH_BYTES,
) -> torch.Tensor:
    """x @ W.T + b where `write(w, n0, n1)` writes rows n0..n1 of W into w (x's dtype),
    blocks of rows that fit in `scratch_bytes` (16 rows at least)."""
    k = x.shape[-1]
    block = max(16, scratch_bytes // (k * x.element_size()))
    bias = None if bias is None else bias.to(x.dtype)
    if block >= out_features:
        w = _scratch_rows(out_features, k, x.dtype)
        write(w, 0, out_features)
        return F.linear(x, w, bias)
    y = x.new_empty(*x.shape[:-1], out_features)
    for n0 in range(0, out_features, block):
        n1 = min(n0 + block, out_features)
        w = _scratch_rows(n1 - n0, k, x.dtype)
        write(w, n0, n1)
        y[..., n0:n1] = F.linear(x, w, None if bias is None else bias[n0:n1])
    return y


def _rows(t: torch.Tensor | None, n0: int, n1: int) -> torch.Tensor | None:
    return None if t is None else t[n0:n1]


class Int4PackedLinear:
    """x @ W.T + b through ATen's `_weight_int4pack_mm_for_cpu` over codes packed once.

    The kernel computes w = (q - 8) * scale + zero per group; the contract's
    w = q * scale + offset is the same with zero = offset + 8 * scale."""

    kernel = "aten._weight_int4pack_mm_for_cpu"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        codes = unpacked_codes(weight).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        scales = weight.scales.float()
        offsets = torch.zeros_like(scales) if weight.offsets is None else weight.offsets.float()
        # [in / group, out, 2]: (scale, zero) per group, the kernel's layout
        self.scales_zeros = torch.stack((scales, offsets + 8 * scales), -1).transpose(0, 1)
        self.scales_zeros = self.scales_zeros.contiguous()
        self.by_dtype: dict[torch.dtype, torch.Tensor] = {}
        self.group_size = weight.scheme.group_size
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scales_zeros = self.by_dtype.get(x.dtype)
        if scales_zeros is None:
            scales_zeros = self.by_dtype.setdefault(x.dtype, self.scales_zeros.to(x.dtype))
        flat = x.reshape(-1, x.shape[-1])
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size,
                                                       scales_zeros)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Uint8QuantizedLinear:
    """x @ W.T + b for 6- and 8-bit integer schemes (GGUF Q8_0, Q6_K; 8-bit GPTQ) through
    the kernels' `quantized_linear_u8` over the codes as stored (uint8 [out, in], float32
    scales and offsets per group): float32 or bf16 activations, float32 accumulation.
    `kernel` names the path (tests assert it ran). Past `DEQUANTIZE_ROWS[x.dtype]` rows of
    x (a prompt chunk) the weight is written out in x's dtype for the call (the kernels'
    `dequantize_u8_into`) and multiplied densely: the kernel reads each weight once per 4
    rows, so at many rows the dense GEMM wins. The row counts are where the 49152x576 tied
    head (Q8_0) crossed over (docs/quantization.md, "Many rows"); the projections cross
    at 16-32 rows.
    `rows_by_path` counts the rows each took."""

    kernel = "tokenmill_cpu.quantized_linear_u8"
    DEQUANTIZE_ROWS = {torch.bfloat16: 16, torch.float32: 48}

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, module) -> None:
        self.module = module
        self.weight = weight
        self.codes = weight.codes.contiguous()
        self.scales = weight.scales.float().contiguous()
        self.offsets = None if weight.offsets is None else weight.offsets.float().contiguous()
        self.group_size = weight.scheme.group_size
        self.bias = None if bias is None else bias.detach()
        self.rows_by_path = {"kernel": 0, "dequantized": 0}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.dtype in _U8_DTYPES and rows > self.DEQUANTIZE_ROWS[x.dtype]:
            # the weight written out in x's dtype by the kernels, then one dense GEMM
            self.rows_by_path["dequantized"] += rows
            return self.dequantized(x)
        if x.dtype not in _U8_DTYPES:
            if x.dtype not in _U8_LOGGED:
                _U8_LOGGED.add(x.dtype)
                logger.warning("tokenmill-cpu: the 6/8-bit quantized-linear kernel takes %s "
                               "activations, not %s: the core's reference runs them",
                               [str(d) for d in _U8_DTYPES], x.dtype)
            return quantized_linear(x, self.weight, self.bias)
        self.rows_by_path["kernel"] += rows
        return self.module.quantized_linear_u8(x, self.codes, self.scales, self.offsets,
                                               self.bias, self.group_size)

    def dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b with W written out for this call in x's dtype (the kernels'
        `dequantize_u8_into`, `linear_written_out`) and dense GEMMs: for many rows of x."""
        def write(w: torch.Tensor, n0: int, n1: int) -> None:
            self.module.dequantize_u8_into(w, self.codes[n0:n1], self.scales[n0:n1],
                                           _rows(self.offsets, n0, n1), self.group_size)

        return linear_written_out(x, write, self.weight.out_features, self.bias)


def repack_q4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] in [0, 16) -> the layout of the kernels' `quantized_linear_q4`
    ([out, in / 2]): per block of 32 columns 16 bytes, byte i = column i | column i + 16
    << 4 (llama.cpp's Q4_0 order), so the kernel unpacks a block with one load and a shift."""
    out, n = codes.shape
    if n % 32:
        raise ValueError(f"repack_q4 takes blocks of 32 columns; in_features={n}")
    blocks = codes.to(torch.uint8).reshape(out, n // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, n // 2).contiguous()


class Int4QuantizedLinear:
    """x @ W.T + b for 4-bit integer schemes (GGUF Q4_0 / Q4_1, AWQ / GPTQ int4) whose
    group is a multiple of 32. Up to `ATEN_ROWS` rows of bf16 activations run ATen's int4
    kernel (`Int4PackedLinear`, built on first use) where it takes the shape: it beat the
    plugin's kernel at every batch measured (1.3-1.8x at batch 1; docs/quantization.md,
    "The 4-bit cpu kernel"). Up to `KERNEL_ROWS` rows of float32 activations, and of bf16
    ones ATen does not take, run the kernels' `quantized_linear_q4` (float32 FMAs over the
    nibbles): 10-70x faster than ATen's int4 kernel with float32 activations and 1.1-2x
    faster than dense float32 at batch 1. Past them (a prompt chunk, a large decode batch)
    the kernels' `dequantize_q4_into` writes the weight out in x's dtype for the call and
    one dense GEMM runs (`dequantized`). `kernel` names the small-batch path;
    `rows_by_path` counts the rows each path took (tests assert the paths ran)."""

    kernel = "tokenmill_cpu.quantized_linear_q4"
    # the row counts up to which a small-batch path beat dequantize-and-multiply on
    # SmolLM2's four shapes (docs/quantization.md, "Many rows"): the plugin's kernel with
    # float32 activations, ATen's int4 kernel with bf16 ones
    KERNEL_ROWS = 32
    ATEN_ROWS = 16

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, module) -> None:
        self.module = module
        self.weight = weight
        # each path's packed codes made on its first call (a bf16 model never repacks
        # for the kernel, a float32 one never packs for ATen)
        self._codes: torch.Tensor | None = None
        self.scales = weight.scales.float().contiguous()
        self.offsets = None if weight.offsets is None else weight.offsets.float().contiguous()
        self.group_size = weight.scheme.group_size
        self.bias = None if bias is None else bias.detach()
        self.rows_by_path = {"kernel": 0, "aten_int4": 0, "dequantized": 0}
        self._aten: Int4PackedLinear | None = None
        # ATen's int4 pack wants out_features % 16 == 0 and one of its group sizes
        self.aten_takes_it = (weight.out_features % 16 == 0 and self.group_size in _INT4_GROUPS
                              and int4_kernel_available())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.dtype not in _U8_DTYPES:
            if x.dtype not in _Q4_LOGGED:
                _Q4_LOGGED.add(x.dtype)
                logger.warning("tokenmill-cpu: the 4-bit quantized-linear kernel takes %s "
                               "activations, not %s: the core's reference runs them",
                               [str(d) for d in _U8_DTYPES], x.dtype)
            return quantized_linear(x, self.weight, self.bias)
        if x.dtype == torch.bfloat16 and self.aten_takes_it and rows <= self.ATEN_ROWS:
            if self._aten is None:
                self._aten = Int4PackedLinear(self.weight, self.bias)
            self.rows_by_path["aten_int4"] += rows
            return self._aten(x)
        if rows <= self.KERNEL_ROWS:
            if self._codes is None:
                self._codes = repack_q4(unpacked_codes(self.weight))
            self.rows_by_path["kernel"] += rows
            return self.module.quantized_linear_q4(x, self._codes, self.scales, self.offsets,
                                                   self.bias, self.group_size)
        self.rows_by_path["dequantized"] += rows
        return self.dequantized(x)

    def dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b with W written out for this call in x's dtype (the kernels'
        `dequantize_q4_into`, `linear_written_out`) and dense GEMMs: for many rows of x."""
        if self._codes is None:
            self._codes = repack_q4(unpacked_codes(self.weight))
        codes = self._codes

        def write(w: torch.Tensor, n0: int, n1: int) -> None:
            self.module.dequantize_q4_into(w, codes[n0:n1], self.scales[n0:n1],
                                           _rows(self.offsets, n0, n1), self.group_size)

        return linear_written_out(x, write, self.weight.out_features, self.bias)


_Q4_LOGGED: set[torch.dtype] = set()


# Bit widths whose codes are one uint8 per weight (platforms/ops/quant.py); activations the
# kernel takes (others go to the reference)
_U8_BITS = (6, 8)
_U8_DTYPES = (torch.float32, torch.bfloat16)
_U8_LOGGED: set[torch.dtype] = set()


def prepack_quantized_linear(
    weight: QuantizedWeight, bias: torch.Tensor | None,
    fallback: ReferenceQuantizedLinear | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """4-bit integer schemes with a group a multiple of 32 through `Int4QuantizedLinear`
    (the kernels' `quantized_linear_q4` for float32 activations at small batch, ATen's CPU
    int4 weight-only matmul for bf16), else with a group ATen takes through ATen's; 6- and
    8-bit ones (group a multiple of 8) through the kernels' `quantized_linear_u8` when the
    kernels are built; anything else goes to `fallback`,
    the core's reference that logs once per scheme (the plugin passes one per platform; a
    new one when None)."""
    scheme = weight.scheme
    on_cpu = weight.codes.device.type == "cpu" and not scheme.is_fp8
    if on_cpu and scheme.bits == 4 and scheme.group_size % 32 == 0:
        module = kernels.load()
        if module is not None:
            return Int4QuantizedLinear(weight, bias, module)
    if on_cpu and scheme.bits == 4 and scheme.group_size in _INT4_GROUPS and int4_kernel_available():
        return Int4PackedLinear(weight, bias)
    if on_cpu and scheme.bits in _U8_BITS and scheme.group_size % 8 == 0:
        module = kernels.load()
        if module is not None:
            return Uint8QuantizedLinear(weight, bias, module)
    fallback = fallback or ReferenceQuantizedLinear("platform plugin 'cpu'")
    return fallback(weight, bias)
