"""Quantized weights: the per-layer scheme, the storage every scheme shares, and the
pure-PyTorch reference of the quantized linear (the conformance oracle and the fallback).

One storage for every integer format (GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, AWQ, GPTQ):
each output row is cut into groups of `group_size` input columns, and a weight is

    w[o, i] = codes[o, i] * scales[o, i // group_size] + offsets[o, i // group_size]

with `codes` unsigned integers of `bits` bits. The formats' own forms map onto it
exactly: GGUF Q4_1's `q * d + m` is (d, m); Q4_0's `(q - 8) * d` is (d, -8 d); Q8_0's
signed `q * d` stores q + 128 with (d, -128 d); an integer zero point z (AWQ, GPTQ) is
offset -z * s. FP8 stores its values as `float8_e4m3fn` codes with one float32 scale per
block of `fp8_block` (rows, columns) (the whole matrix for per-tensor scales) and no
offsets: w = codes * scales[o // block_rows, i // block_cols].

Layouts: 4-bit codes are packed two to a byte along the input dim (byte j of a row holds
columns 2j in its low nibble and 2j + 1 in its high one): uint8 [out, in / 2]; 6- and
8-bit codes are uint8 [out, in]; `scales` and `offsets` are float32 [out, in / group].
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

QUANT_METHODS = ("gguf", "awq", "gptq", "fp8")

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class QuantScheme:
    """How one layer's weight is quantized (see the module docstring).

    `method`: the checkpoint format (one of QUANT_METHODS); `format`: its name for the
    layer (GGUF's type name, "int4", "fp8_e4m3"); `bits`: bits per code; `group_size`:
    input columns sharing one scale (integer formats); `zero_points`: whether `offsets`
    are stored; `fp8_block`: (rows, columns) sharing one FP8 scale, None for integer
    formats.
    """

    method: str
    format: str
    bits: int
    group_size: int = 0
    zero_points: bool = True
    fp8_block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise ValueError(f"quantization method {self.method!r} is not one of {QUANT_METHODS}")
        if self.fp8_block is None and (self.bits not in (4, 6, 8) or self.group_size <= 0):
            raise ValueError(f"integer scheme {self.format!r} needs bits in (4, 6, 8) and a "
                             f"positive group_size; got bits={self.bits}, "
                             f"group_size={self.group_size}")

    @property
    def is_fp8(self) -> bool:
        return self.fp8_block is not None

    def codes_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        """The shape of `codes` for an [out, in] weight."""
        if self.bits == 4 and not self.is_fp8:
            if in_features % 2:
                raise ValueError(f"4-bit codes pack column pairs; in_features={in_features} is odd")
            return out_features, in_features // 2
        return out_features, in_features

    def scales_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        """The shape of `scales` (and `offsets`) for an [out, in] weight."""
        if self.fp8_block is not None:
            rows, cols = self.fp8_block
            return -(-out_features // rows), -(-in_features // cols)
        if in_features % self.group_size:
            raise ValueError(f"{self.format}: in_features={in_features} is not a multiple of "
                             f"the group size {self.group_size}")
        return out_features, in_features // self.group_size


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """One layer's quantized weight as the ops see it (tensors in the module docstring's
    layouts); `offsets` is None when the scheme stores no zero points."""

    scheme: QuantScheme
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    in_features: int
    out_features: int


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] codes in [0, 16) -> uint8 [..., n / 2], column pairs per byte."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: uint8 [..., n / 2] -> uint8 [..., n]."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def unpacked_codes(weight: QuantizedWeight) -> torch.Tensor:
    """The codes one per column: uint8 [out, in] (float8 [out, in] for FP8)."""
    if weight.scheme.bits == 4 and not weight.scheme.is_fp8:
        return unpack_int4(weight.codes)
    return weight.codes


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [out, in] in `dtype`, computed in float32 (the oracle's definition)."""
    codes = unpacked_codes(weight).float()
    scheme = weight.scheme
    if scheme.fp8_block is not None:
        rows, cols = scheme.fp8_block
        scales = weight.scales.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        w = codes * scales[: weight.out_features, : weight.in_features]
        return w.to(dtype)
    g = scheme.group_size
    w = codes * weight.scales.float().repeat_interleave(g, 1)
    if weight.offsets is not None:
        w = w + weight.offsets.float().repeat_interleave(g, 1)
    return w.to(dtype)


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ dequantize(weight).T + bias in x's dtype: the reference every platform's
    quantized matmul is compared against. Does not modify its inputs."""
    return F.linear(x, dequantize(weight, x.dtype), bias)


def prepack_quantized_linear(
    weight: QuantizedWeight, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Called once per quantized linear layer after its weights are loaded; returns y = f(x)
    computing `quantized_linear(x, weight, bias)`. A platform repacks the codes for its
    own kernel here (the returned function owns the packed copy); the reference keeps the
    codes as they are and dequantizes on every call (exact, slow). Does not modify
    `weight` or `bias`."""
    return functools.partial(quantized_linear, weight=weight, bias=bias)


class ReferenceQuantizedLinear:
    """`prepack_quantized_linear` of a platform that runs the reference instead of a
    kernel of its own (every scheme when it overrides nothing, the ones its kernel does
    not take otherwise): the reference, with one warning per scheme naming `platform`
    and the scheme, so the slow path (dequantized on every call) is never silent.

    `resolve_ops` puts one in for a platform that does not override the op; a plugin
    whose kernel covers some schemes calls one for the rest, e.g.
    `fallback = ReferenceQuantizedLinear("platform plugin 'cpu'")`, then
    `return fallback(weight, bias)`."""

    def __init__(self, platform: str) -> None:
        self.platform = platform
        self.logged: set[QuantScheme] = set()  # the schemes warned about

    def __call__(
        self, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        scheme = weight.scheme
        if scheme not in self.logged:
            self.logged.add(scheme)
            shape = (f"block {scheme.fp8_block}" if scheme.is_fp8
                     else f"{scheme.bits} bits, group {scheme.group_size}")
            logger.warning(
                "%s has no quantized-linear kernel for %s %s weights (%s): the core's "
                "reference runs them, dequantizing on every call; serve with "
                "--quantization none to dequantize once at load", self.platform,
                scheme.method, scheme.format, shape)
        return prepack_quantized_linear(weight, bias)
