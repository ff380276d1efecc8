"""How tier T1 compares a plugin's result with the reference: bounds on the largest error
and statistics of the error over many elements.

Elementwise tolerances alone let a systematic error through: an output scaled by 1.01 stays
inside bfloat16's rtol of 2e-2, and so does a small constant bias. So besides the max-error
bound (`torch.testing.assert_close` with atol/rtol) every comparison of enough elements
checks three statistics of the error d = got - want against the reference r, computed in
float64:

- relative RMS error: sqrt(mean d^2) / sqrt(mean r^2), the error's size against the signal's;
- mean signed error: mean(d) / sqrt(mean r^2), a bias that rounding (unbiased, to nearest)
  does not produce;
- scale error: sum(d r) / sum(r r), the least-squares slope of d on r, a systematic scale
  (1.01 x the reference gives 0.01).

Rounding noise averages out of the last two as 1 / sqrt(n), so with thousands of elements
their bounds sit far below bfloat16's epsilon (7.8e-3) and a 1% scale or bias fails. A
failure names the op, the shape and the dtype, and lists every statistic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Bounds:
    """What a comparison in one dtype allows."""

    atol: float  # elementwise: |d| <= atol + rtol * |r|
    rtol: float
    rel_rms: float  # bounds of the statistics (module docstring)
    mean: float
    scale: float


# Outputs of attention-like ops (softmax-weighted sums, recurrent states) against their
# float32-math references; a plugin computes in float32 and rounds once, as they do.
ATTENTION_BOUNDS = {
    torch.float32: Bounds(atol=1e-4, rtol=1e-4, rel_rms=2e-5, mean=5e-6, scale=5e-6),
    torch.float16: Bounds(atol=5e-3, rtol=5e-3, rel_rms=2e-3, mean=4e-4, scale=4e-4),
    # rounding noise measured on the cpu and Triton kernels: relative RMS ~2e-3, mean and
    # scale errors ~1e-4 over a few thousand elements
    torch.bfloat16: Bounds(atol=2e-2, rtol=2e-2, rel_rms=6e-3, mean=2e-3, scale=2e-3),
}
# Below this many elements the statistics are noise: only the max-error bound applies.
MIN_ELEMENTS = 1024


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """The error of one comparison (module docstring); `num` elements."""

    num: int
    max_abs: float
    rel_rms: float
    mean: float
    scale: float

    def describe(self) -> str:
        return (f"{self.num} elements: max |error| {self.max_abs:.3g}, relative RMS error "
                f"{self.rel_rms:.3g}, mean signed error {self.mean:+.3g}, scale error "
                f"{self.scale:+.3g} (relative to the reference's RMS)")


def error_stats(got: torch.Tensor, want: torch.Tensor) -> ErrorStats:
    """Statistics of got - want over the elements where the reference is finite."""
    g = got.detach().cpu().double().flatten()
    w = want.detach().cpu().double().flatten()
    finite = torch.isfinite(w)
    g, w = g[finite], w[finite]
    d = g - w
    if d.numel() == 0:
        return ErrorStats(0, 0.0, 0.0, 0.0, 0.0)
    power = float((w * w).mean())
    rms = math.sqrt(power) if power > 0 else 1.0
    return ErrorStats(
        num=d.numel(),
        max_abs=float(d.abs().max()),
        rel_rms=float(d.pow(2).mean().sqrt()) / rms,
        mean=float(d.mean()) / rms,
        scale=float((d * w).sum() / (w * w).sum()) if power > 0 else 0.0,
    )


def assert_matches(
    got: torch.Tensor,
    want: torch.Tensor,
    *,
    op: str,
    shape: str,
    dtype: torch.dtype,
    bounds: Bounds | None = None,
) -> ErrorStats:
    """Fails naming `op`, `shape` and `dtype` when `got` is outside the max-error bound
    or, over at least MIN_ELEMENTS elements, any statistic is outside its bound."""
    bounds = bounds or ATTENTION_BOUNDS[dtype]
    where = f"{op} at {shape} in {str(dtype).removeprefix('torch.')}"
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    got_cpu = got.detach().cpu()
    stats = error_stats(got_cpu, want)
    torch.testing.assert_close(
        got_cpu.to(want.dtype), want, atol=bounds.atol, rtol=bounds.rtol,
        msg=lambda message: f"{where}: {message}\n({stats.describe()})",
    )
    if stats.num < MIN_ELEMENTS:
        return stats
    for name, value, bound in (
        ("relative RMS error", stats.rel_rms, bounds.rel_rms),
        ("mean signed error (a bias)", abs(stats.mean), bounds.mean),
        ("scale error (a systematic scale)", abs(stats.scale), bounds.scale),
    ):
        assert value <= bound, (
            f"{where}: {name} {value:.3g} exceeds {bound:.3g}: the result is systematically "
            f"off the reference although each element is within atol={bounds.atol}, "
            f"rtol={bounds.rtol} ({stats.describe()})"
        )
    return stats
