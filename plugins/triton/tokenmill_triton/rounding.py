"""float32 -> bfloat16 casts that round to nearest even in Triton's interpreter too.

GPUs (and torch) round a float32 to the nearest bf16, ties to even. Triton 3.9's
interpreter instead truncates (it drops the low 16 bits, whatever `fp_downcast_rounding`
says), so each bf16 rounding of an interpreted kernel errs by up to one bf16 step, always
toward zero. One such rounding per output hides inside an elementwise tolerance; a chain of
them does not: in the MoE op (gate/up GEMM, activation, down GEMM, each rounded to bf16
where the reference rounds) the biased errors compounded to 4x the reference's own error
against float64 and T1 refused it. `to_dtype(x, dtype, RTNE_BF16)` rounds in integer
arithmetic when RTNE_BF16 is set and reinterprets the bits (no cast);
kernels set it from `exact_bf16_casts()` (interpreter mode only: the hardware cast already
rounds this way). tests/triton/kernel_cases.py checks it against torch's cast bit for bit
and says when the interpreter no longer needs it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill_triton.configs import interpreter_mode


def exact_bf16_casts() -> bool:
    """Whether kernels must round float32 -> bf16 themselves (Triton's interpreter)."""
    return interpreter_mode()


@triton.jit
def round_to_bf16(x):
    """bf16(x) for float32 x, rounded to nearest even: add 0x7FFF plus the kept lowest bit,
    keep the high 16 bits (a carry into the exponent is the correct rounding up, overflow to
    inf included) and reinterpret them, so no cast of the interpreter's touches the value
    (its casts also mangle subnormals); NaN becomes the quiet NaN 0x7FC0, as torch's."""
    bits = x.to(tl.uint32, bitcast=True)
    kept_lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + kept_lsb) >> 16).to(tl.uint16)
    rounded = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)
    return rounded.to(tl.bfloat16, bitcast=True)


@triton.jit
def to_dtype(x, dtype: tl.constexpr, RTNE_BF16: tl.constexpr):
    """x cast to `dtype`, float32 -> bf16 rounded to nearest even also where the cast
    itself truncates (RTNE_BF16: the interpreter)."""
    if RTNE_BF16 and dtype == tl.bfloat16:
        return round_to_bf16(x.to(tl.float32))
    return x.to(dtype)


@triton.jit
def fp8_bits(x, MANT: tl.constexpr, MIN_EXP: tl.constexpr, BIAS: tl.constexpr):
    """The FP8 code (uint8) of float32 `x`, already saturated to the format's finite range,
    rounded to nearest even as torch's cast rounds: `MANT` mantissa bits, `MIN_EXP` the
    smallest normal exponent, `BIAS` the exponent bias (e4m3fn: 3, -6, 7; e5m2: 2, -14,
    15). Built from the bits, so no cast touches the value: the 3.9 interpreter's float32
    -> fp8 cast rounds ties away and drops the carry of a mantissa that rounds up (1.97 ->
    1.0). Normal values keep the top MANT bits of the float32 mantissa, rounded in integer
    arithmetic (a carry into the exponent is the right rounding up); below 2^MIN_EXP the
    value counts units of 2^(MIN_EXP - MANT), rounded by the float32 adder (ties to even)
    against 1.5 * 2^23 (a count of 2^MANT is the smallest normal's code, as it should be)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = ((bits >> 31) << 7).to(tl.uint32)
    a_bits = bits & 0x7FFFFFFF
    shift: tl.constexpr = 23 - MANT
    lsb = (a_bits >> shift) & 1
    rounded = a_bits + ((1 << (shift - 1)) - 1) + lsb
    exponent = (rounded >> 23).to(tl.int32) - 127 + BIAS
    normal = (exponent.to(tl.uint32) << MANT) | ((rounded >> shift) & ((1 << MANT) - 1))
    units = tl.abs(x) * (2.0 ** (MANT - MIN_EXP))
    magic = 12582912.0  # 1.5 * 2^23: adding it rounds a float32 below 2^22 to an integer
    subnormal = ((units + magic) - magic).to(tl.uint32)
    code = tl.where(tl.abs(x) < 2.0**MIN_EXP, subnormal, normal)
    return (code | sign).to(tl.uint8)
