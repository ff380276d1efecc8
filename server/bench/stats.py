"""Latency percentiles, per-run summaries and goodput for the serving benchmark (no I/O)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds, relative to the run's start."""

    session: str
    turn: int
    start: float
    ok: bool = False
    error: str = ""
    ttft: float = math.nan          # first content token
    e2e: float = math.nan           # last byte
    itls: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0          # usage.completion_tokens, else content chunks counted
    prompt_tokens: int = 0          # usage.prompt_tokens (sent)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if exposed
    expected_prompt_tokens: int = 0  # what the workload meant to send (before templates)
    text: str = ""

    @property
    def tpot(self) -> float:
        """Time per output token after the first."""
        if self.output_tokens <= 1:
            return math.nan
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaNs are dropped."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Slo:
    """A request is 'good' when it finished and met every bound (seconds)."""

    ttft: float = 2.0
    tpot: float = 0.1

    def met(self, r: RequestResult) -> bool:
        tpot = r.tpot
        return r.ok and r.ttft <= self.ttft and (math.isnan(tpot) or tpot <= self.tpot)


def summarize(results: list[RequestResult], duration: float, slo: Slo) -> dict[str, float]:
    """Throughput, goodput and p50/p90/p99 of TTFT, ITL, TPOT and E2E (ms) for one run."""
    ok = [r for r in results if r.ok]
    out = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "req_per_s": len(ok) / duration if duration > 0 else math.nan,
        # tokens streamed by cancelled requests count too: they were computed in the window
        "output_tok_per_s": sum(r.output_tokens for r in results) / duration
        if duration > 0 else math.nan,
        "total_tok_per_s": sum(r.output_tokens + r.prompt_tokens for r in ok) / duration
        if duration > 0 else math.nan,
        "goodput_req_per_s": sum(slo.met(r) for r in ok) / duration if duration > 0 else math.nan,
        "slo_ttft_s": slo.ttft,
        "slo_tpot_s": slo.tpot,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
    }
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    out["cached_tokens"] = sum(cached) if cached else math.nan
    series = {
        "ttft": [r.ttft for r in ok],
        "itl": [x for r in ok for x in r.itls],
        "tpot": [r.tpot for r in ok],
        "e2e": [r.e2e for r in ok],
    }
    for name, values in series.items():
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = percentile(values, q) * 1000
    return out


def median(values: list[float]) -> float:
    return percentile(values, 50)
