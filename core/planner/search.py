"""The search: every valid mix of the cluster, colocated or as prefill / decode pools, and
every xPyD split of the cluster into prefill and decode instances; ranked.

Ranking: candidates that fit and meet the SLO first, then by tokens per second per device
(output tokens; a prefill pool's prompt tokens), then by TTFT. A disaggregated split
serves min(x prefill capacity, y decode capacity) requests/s and is charged every device
of both pools; its TTFT adds the KV handover (the prompt's KV over the inter-node link).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tokenmill.planner.memory import kv_bytes_per_sequence
from tokenmill.planner.mixes import Mix, engine_layouts
from tokenmill.planner.serving import (
    Context,
    Prediction,
    decode_tpot,
    predict_colocated,
    predict_decode,
    predict_prefill,
    queued_ttft,
)

POOL_TOP = 6  # prefill and decode instance layouts combined into xPyD splits, each


@dataclass(frozen=True, slots=True)
class Candidate:
    kind: str  # "colocated", "prefill pool", "decode pool", "disaggregated"
    ttft_s: float
    tpot_s: float
    tokens_per_s_per_device: float
    requests_per_s: float
    kv_sessions: int
    binding: str
    meets_slo: bool
    fits: bool
    devices: int
    mix: Mix | None = None  # colocated or a pool
    prefill: Prediction | None = None  # disaggregated: x instances of prefill.mix
    decode: Prediction | None = None  # and y of decode.mix
    x: int = 0
    y: int = 0
    note: str = ""
    step_link_share: float = 0.0  # share of the binding step spent in collectives

    def label(self) -> str:
        if self.kind == "disaggregated":
            assert self.prefill is not None and self.decode is not None
            return f"{self.x}P({self.prefill.mix.label()}) + {self.y}D({self.decode.mix.label()})"
        assert self.mix is not None
        return self.mix.label()


def sort_key(c: Candidate) -> tuple:
    return (not c.fits, not c.meets_slo, -round(c.tokens_per_s_per_device, 6),
            c.ttft_s if not math.isnan(c.ttft_s) else 0.0,
            c.tpot_s if not math.isnan(c.tpot_s) else 0.0, c.devices)


def candidate_mixes(ctx: Context) -> list[Mix]:
    """Engine layouts times data-parallel replicas that use every device (a shared host:
    any number of its ranks up to the cluster's)."""
    cluster = ctx.cluster
    mixes = []
    for layout in engine_layouts(cluster.devices, ctx.model, cluster.devices_per_node):
        fills = range(1, cluster.devices // layout.world + 1) if cluster.shared_host else (
            cluster.devices // layout.world,)
        mixes += [replace(layout, dp=dp) for dp in fills]
    return mixes


def _candidate(pred: Prediction, kind: str) -> Candidate:
    return Candidate(kind, pred.ttft_s, pred.tpot_s, pred.tokens_per_s_per_device,
                     pred.requests_per_s, pred.kv_sessions, pred.binding, pred.meets_slo,
                     pred.fits, pred.mix.devices, mix=pred.mix, note=pred.note)


def search(ctx: Context, pool: str | None = None) -> list[Candidate]:
    """Ranked candidates. `pool`: "prefill" or "decode" (one role of a disaggregated
    deployment), "both" (colocated only), None (colocated and every xPyD split)."""
    mixes = candidate_mixes(ctx)
    out: list[Candidate] = []
    if pool in (None, "both"):
        out += [_candidate(predict_colocated(ctx, m), "colocated") for m in mixes]
    if pool == "prefill":
        out += [_candidate(predict_prefill(ctx, m), "prefill pool") for m in mixes]
    if pool == "decode":
        out += [_candidate(predict_decode(ctx, m), "decode pool") for m in mixes]
    if pool is None and ctx.cluster.devices >= 2:
        out += disaggregated(ctx)
    return sorted(out, key=sort_key)


def disaggregated(ctx: Context) -> list[Candidate]:
    """Every split of the cluster into x prefill and y decode instances, over the best
    `POOL_TOP` instance layouts of each role (per device, within the SLO)."""
    n = ctx.cluster.devices
    layouts = [m for m in engine_layouts(n, ctx.model, ctx.cluster.devices_per_node)
               if m.devices < n]
    unloaded = replace(ctx, workload=replace(ctx.workload, rate=None, concurrency=None))
    prefills = _top([predict_prefill(_less_handover(unloaded, m), m) for m in layouts])
    decodes = _top([predict_decode(unloaded, m) for m in layouts])
    out = []
    for p in prefills:
        for d in decodes:
            for x in range(1, (n - d.mix.devices) // p.mix.devices + 1):
                y = (n - x * p.mix.devices) // d.mix.devices
                if y >= 1:
                    out.append(split(ctx, p, d, x, y))
    return out


def split(ctx: Context, p: Prediction, d: Prediction, x: int, y: int) -> Candidate:
    """x instances of `p`'s prefill layout and y of `d`'s decode layout. On a shared host
    the two pools compute at once on the same cores: each pool is priced again with the
    other instances' ranks busy beside it (`Context.cotenant_ranks`; as if always busy,
    an upper bound on the contention), where separate devices keep the unloaded figures."""
    if not ctx.cluster.shared_host:
        return _split(ctx, p, d, x, y)
    devices = x * p.mix.devices + y * d.mix.devices
    unloaded = replace(ctx, workload=replace(ctx.workload, rate=None, concurrency=None))
    pctx = replace(unloaded, cotenant_ranks=devices - p.mix.devices)
    dctx = replace(ctx, cotenant_ranks=devices - d.mix.devices)
    p = predict_prefill(_less_handover(pctx, p.mix), p.mix)
    d = predict_decode(replace(dctx, workload=unloaded.workload), d.mix)
    return _split(dctx, p, d, x, y)


def _less_handover(ctx: Context, prefill: Mix) -> Context:
    """`ctx` with the TTFT SLO less the KV handover, which the prefill pool must leave."""
    if ctx.slo.ttft is None:
        return ctx
    budget = ctx.slo.ttft - handover_seconds(ctx, prefill, prefill)
    return replace(ctx, slo=replace(ctx.slo, ttft=max(budget, 1e-9)))


def _top(preds: list[Prediction]) -> list[Prediction]:
    ok = [p for p in preds if p.fits]
    ok.sort(key=lambda p: (not p.meets_slo, -p.tokens_per_s_per_device))
    return ok[:POOL_TOP]


def _split(ctx: Context, p: Prediction, d: Prediction, x: int, y: int) -> Candidate:
    """x prefill and y decode instances: their capacity, and under an offered load (a
    rate, or clients in a closed loop: Little's law) the decode batch the load settles
    at and its TPOT."""
    wl = ctx.workload
    capacity = min(x * p.requests_per_s, y * d.requests_per_s)
    devices = x * p.mix.devices + y * d.mix.devices
    handover = handover_seconds(ctx, p.mix, d.mix)
    tpots: dict[int, float] = {}

    def at(rate: float) -> tuple[float, float]:
        """The TTFT and TPOT an arrival rate gives: the decode batch it settles at
        (Little's law over the decode pool) and the prefill pool's queue."""
        tpot = d.tpot_s
        for _ in range(3):
            batch = min(d.batch, math.ceil(rate * wl.osl * tpot / (y * d.mix.dp)))
            if batch not in tpots:
                tpots[batch] = decode_tpot(ctx, d.mix, batch)
            tpot = tpots[batch]
        queued = queued_ttft(p, rate / x)
        if wl.concurrency is not None:  # C clients: at most all of them queued at once
            queued = min(queued, p.service_s * math.ceil(wl.concurrency / x))
        return queued + handover, tpot

    if wl.concurrency is not None:
        # a closed loop settles where the rate is the clients over a request's time, a
        # time that grows with the rate: the crossing, by bisection (iterating the rate
        # itself oscillates near the prefill pool's capacity)
        low, high = 0.0, capacity
        for _ in range(30):
            mid = (low + high) / 2
            ttft, tpot = at(mid)
            low, high = (mid, high) if wl.concurrency / (ttft + wl.osl * tpot) > mid else (low, mid)
        rate = low
        ttft, tpot = at(rate)
    elif wl.rate is not None:
        rate = min(capacity, wl.rate)
        ttft, tpot = at(rate)
    else:
        rate, ttft, tpot = capacity, p.ttft_s + handover, d.tpot_s
    overloaded = wl.rate is not None and wl.rate > capacity
    meets = ctx.slo.met(ttft, tpot) and p.meets_slo and d.meets_slo and not overloaded
    limiting = "prefill pool" if x * p.requests_per_s < y * d.requests_per_s else "decode pool"
    binding = f"{limiting}: {(p if limiting == 'prefill pool' else d).binding}"
    return Candidate("disaggregated", ttft, tpot, rate * wl.osl / devices, rate,
                     min(p.kv_sessions, d.kv_sessions), binding, meets, True, devices,
                     prefill=p, decode=d, x=x, y=y,
                     note="cannot sustain the offered load" if overloaded else "")


def handover_seconds(ctx: Context, prefill: Mix, decode: Mix) -> float:
    """A prompt's KV (the whole model's, as one rank of tp 1 would hold it) from a
    prefill to a decode instance over the inter-node link, one stream per rank of the
    smaller instance."""
    total = kv_bytes_per_sequence(ctx.model, Mix(), ctx.workload.isl)
    streams = min(prefill.world, decode.world)
    link = ctx.cluster.intra if ctx.cluster.shared_host else ctx.cluster.inter
    return link.latency + total / (streams * link.bandwidth)
