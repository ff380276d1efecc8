"""Capacity under a replay: the most concurrent sessions an engine serves within a TTFT SLO.

A point (one session count) passes when every request it sent finished and the chosen
percentile of TTFT over its turns is at most the SLO. No I/O here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from tokenmill.server.bench.stats import percentile


@dataclass(frozen=True, slots=True)
class PointVerdict:
    sessions: int
    ttft_ms: float  # the percentile of TTFT over the finished turns (nan: none finished)
    requests: int
    failed: int
    passed: bool
    reason: str  # why it failed; "" when it passed


def judge_point(
    sessions: int, ttfts_s: list[float], failed: int, slo_ttft_s: float, q: float
) -> PointVerdict:
    """`ttfts_s`: TTFT of each finished request; `failed`: requests sent that did not finish."""
    p = percentile(ttfts_s, q)
    n = len(ttfts_s) + failed
    reason = ""
    if failed:
        reason = f"{failed} of {n} requests failed"
    elif not ttfts_s:
        reason = "no request finished"
    elif p > slo_ttft_s:
        reason = f"p{q:g} TTFT {p * 1000:.0f} ms > {slo_ttft_s * 1000:.0f} ms"
    return PointVerdict(sessions, p * 1000, n, failed, not reason, reason)


def max_sessions_at_slo(verdicts: Iterable[PointVerdict]) -> tuple[int, bool]:
    """(the largest session count that passed with every smaller count measured also
    passing, or 0 when the smallest failed; whether every count passed, in which case the
    figure is only a lower bound). A count measured more than once passes only if every
    repeat passed."""
    passed: dict[int, bool] = defaultdict(lambda: True)
    for v in verdicts:
        passed[v.sessions] &= v.passed
    if not passed:
        return 0, False
    best = 0
    for n in sorted(passed):
        if not passed[n]:
            return best, False
        best = n
    return best, True
