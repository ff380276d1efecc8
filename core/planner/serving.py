"""From step times to what a client sees: TTFT, TPOT and throughput of one mix serving a
workload, colocated (role "both"), as a prefill pool or as a decode pool.

Colocated, the engine's one scheduling rule decides the shape of a step: every running
request decodes one token, and what is left of the token budget goes to prompt chunks.
In a steady state with B requests decoding, each step must also prefill B x ISL' / OSL
prompt tokens (ISL' the tokens past the prefix hit) for new requests to replace the
finished ones; a step carries both, so prefill slows every decode and decodes slow every
prefill. The mean step prices throughput (B tokens a step); a request's TPOT is the mean
of the OSL - 1 steps after its first token, which carry the other B - 1 requests' prompt
chunks but never its own (those come before its first token): one request alone decodes
at the decode step's pace. With pipeline parallel, pp micro-batches of B / pp requests
are in flight: a request's next token waits for its micro-batch to pass every stage (TPOT
= pp stage times) and a prompt's chunks flow through the stages one behind the other
(TTFT = (chunks + pp - 1) stage times, the pipeline bubble). A request waits for the
prefill capacity the decodes leave as an M/D/1 queue: W = rho / (2 (1 - rho)) x service.

The operating point: an offered rate (Little's law: B = rate x OSL x TPOT, solved for B),
a number of concurrent clients, or the largest batch that meets the SLO, the KV cache and
`max_num_seqs` allow (the throughput the planner ranks by).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.planner.calibration import Calibration
from tokenmill.planner.cluster import Cluster
from tokenmill.planner.collectives import cdiv
from tokenmill.planner.memory import kv_bytes_per_sequence, rank_memory
from tokenmill.planner.mixes import Mix
from tokenmill.planner.model_shape import ModelShape
from tokenmill.planner.ops import Seq
from tokenmill.planner.step import StepTime, step_time
from tokenmill.planner.workload import Workload

INF = float("inf")


@dataclass(frozen=True, slots=True)
class Limits:
    """The engine settings the prediction assumes (and `--apply` passes on)."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    long_prefill_token_threshold: int | None = None
    memory_utilization: float = 0.9

    @property
    def chunk(self) -> int:
        return min(self.long_prefill_token_threshold or self.max_num_batched_tokens,
                   self.max_num_batched_tokens)


@dataclass(frozen=True, slots=True)
class SLO:
    ttft: float | None = None  # seconds
    tpot: float | None = None

    def met(self, ttft: float, tpot: float) -> bool:
        return (self.ttft is None or ttft <= self.ttft) and (self.tpot is None or tpot <= self.tpot)


@dataclass(frozen=True, slots=True)
class Prediction:
    role: str  # "both" (colocated), "prefill" or "decode" pool
    mix: Mix
    ttft_s: float  # nan for a decode pool (its requests arrive prefilled)
    tpot_s: float  # nan for a prefill pool
    tokens_per_s_per_device: float  # output tokens (a prefill pool: prompt tokens computed)
    requests_per_s: float  # of the whole mix (all its replicas)
    batch: int  # requests decoding per replica at the operating point
    kv_sessions: int  # sessions of ISL + OSL tokens the KV cache holds, per replica
    binding: str  # compute, memory bandwidth, link, host overhead, KV capacity
    meets_slo: bool
    fits: bool  # the weights and one session fit
    note: str = ""
    service_s: float = math.nan  # a prefill pool: one prompt's TTFT with no queue
    capacity: float = 0.0  # a prefill pool: requests/s of the whole mix at full utilisation


@dataclass(frozen=True, slots=True)
class Context:
    model: ModelShape
    cluster: Cluster
    calibration: Calibration
    workload: Workload
    slo: SLO
    limits: Limits
    # on a shared host: ranks of other instances computing beside this one's (the other
    # pool of a disaggregated deployment on the same host), which take their share of it
    cotenant_ranks: int = 0


def _memory(ctx: Context, mix: Mix) -> tuple[int, str]:
    """(sessions per replica, why none fit)."""
    device = ctx.cluster.device.memory_bytes / (mix.devices if ctx.cluster.shared_host else 1)
    mem = rank_memory(ctx.model, mix, device, ctx.limits.max_num_batched_tokens,
                      ctx.limits.max_num_seqs, ctx.limits.memory_utilization)
    if not mem.fits:
        return 0, (f"weights {mem.weights / 2**30:.1f} GiB + activations "
                   f"{mem.activations / 2**30:.1f} GiB exceed {mem.total / 2**30:.1f} GiB a rank")
    context = ctx.workload.isl + ctx.workload.osl
    per = max(kv_bytes_per_sequence(ctx.model, mix, context, s) for s in range(mix.pp))
    sessions = int(mem.kv // per) if per else 10**9
    return sessions, "" if sessions else f"no session of {context} tokens fits the KV cache"


def _step(ctx: Context, mix: Mix, decode: int, prefill: int, prompts: int = 1) -> StepTime:
    """One micro-batch: `decode` requests decoding at the mean context, and `prompts`
    prompt chunks of `prefill` tokens each at the mean chunk position."""
    wl = ctx.workload
    seqs = []
    if decode:
        seqs.append(Seq(wl.isl + wl.osl // 2, 1, decode))
    if prefill:
        cached = wl.isl - wl.new_tokens + max(0, (wl.new_tokens - prefill) // 2)
        seqs.append(Seq(cached, prefill, prompts))
    busy = None  # step_time's default: every rank of the mix computes
    if ctx.cotenant_ranks and ctx.cluster.shared_host:
        busy = mix.devices + ctx.cotenant_ranks
    return step_time(ctx.model, mix, ctx.cluster, ctx.calibration, tuple(seqs),
                     decode + (prompts if prefill else 0), busy)


@dataclass(frozen=True, slots=True)
class _Point:
    ttft: float
    tpot: float  # a request's mean gap between tokens after its first
    cycle: float  # the mean step (x pp): one token of each of the batch's requests
    step: StepTime
    rho: float  # prefill capacity in use


def _colocated_point(ctx: Context, mix: Mix, batch: int) -> _Point | None:
    """TTFT and TPOT with `batch` requests decoding per replica; None when the budget left
    by the decodes cannot prefill new requests as fast as they finish.

    The scheduler gives a prompt all the budget the decodes leave (up to
    `long_prefill_token_threshold`), so steps are of two kinds: decodes alone, and decodes
    with a prompt chunk of c tokens. A share f = (prompt tokens needed per step) / c of the
    steps carry a chunk; throughput is a token per request per mean step, TTFT the
    prompt's chunks (through every stage) after its wait in the queue of chunked steps
    (rho = f). A request's own chunks all come before its first token, so its OSL - 1
    later steps carry the chunks of the other B - 1 requests only: a share f (B - 1) / B x
    OSL / (OSL - 1) of them (B = 1: none, TPOT = the decode step)."""
    wl, limits, pp = ctx.workload, ctx.limits, mix.pp
    left = limits.max_num_batched_tokens - batch
    needed = batch * wl.new_tokens / wl.osl  # prompt tokens per step to replace finished ones
    chunk = min(limits.chunk, left, wl.new_tokens)
    if chunk <= 0 or needed >= chunk:
        return None
    micro = cdiv(batch, pp)
    alone = _step(ctx, mix, micro, 0)
    # On a shared host every rank computes with its share of the cores, a prompt chunk too:
    # the engine's ranks take cores / ranks intra-op threads each (`share_host_cores`), so
    # a stage cannot take the cores a decoding stage leaves idle (measured: pp2's TTFT
    # 1.2-1.8x tp1's, docs/planner.md run 10; before the ranks shared, 1.0-1.1x)
    mixed = _step(ctx, mix, micro, chunk)
    share = needed / chunk
    cycle = pp * ((1 - share) * alone.seconds + share * mixed.seconds)
    others = min(1.0, share * (batch - 1) / batch * wl.osl / max(wl.osl - 1, 1))
    tpot = pp * ((1 - others) * alone.seconds + others * mixed.seconds)
    service = (cdiv(wl.new_tokens, chunk) + pp - 1) * mixed.seconds
    ttft = service * (1 + share / (2 * (1 - share))) + cycle / 2
    binding = mixed if share * mixed.seconds > (1 - share) * alone.seconds else alone
    return _Point(ttft, tpot, cycle, binding, share)


def _largest(ok, high: int) -> int:
    """The largest b in [1, high] with ok(b) (ok monotone: true then false); 0 if none."""
    if high < 1 or not ok(1):
        return 0
    lo, hi = 1, high
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def predict_colocated(ctx: Context, mix: Mix) -> Prediction:
    sessions, why = _memory(ctx, mix)
    if not sessions:
        return _unfit(mix, "both", why)
    wl, slo = ctx.workload, ctx.slo
    cap = min(ctx.limits.max_num_seqs, sessions)

    def point(b: int) -> _Point | None:
        return _colocated_point(ctx, mix, b)

    if wl.rate is not None or wl.concurrency is not None:
        batch, overloaded = _operating_batch(ctx, mix, cap, point)
    else:
        def ok(b: int) -> bool:
            p = point(b)
            return p is not None and slo.met(p.ttft, p.tpot)
        batch, overloaded = _largest(ok, cap), False
        if batch == 0:  # nothing meets the SLO: report the smallest batch's figures
            batch = 1
    p = point(batch)
    if p is None:
        return _unfit(mix, "both", "the token budget cannot prefill one request per step")
    served = batch / p.cycle * mix.dp  # output tokens/s of every replica
    if wl.rate is not None and not overloaded:
        served = wl.rate * wl.osl
    elif wl.concurrency is not None:
        # a closed loop: each client has a request in flight at every moment, which takes
        # TTFT + (OSL - 1) TPOT (the batch above is rounded up to whole requests)
        served = min(served, wl.concurrency * wl.osl / (p.ttft + (wl.osl - 1) * p.tpot))
    binding = "KV capacity" if batch == sessions and sessions < ctx.limits.max_num_seqs else p.step.binding
    note = "cannot sustain the offered load" if overloaded else ""
    return Prediction("both", mix, p.ttft, p.tpot, served / mix.devices,
                      served / wl.osl, batch, sessions, binding,
                      slo.met(p.ttft, p.tpot) and not overloaded, True, note)


def _operating_batch(ctx: Context, mix: Mix, cap: int, point) -> tuple[int, bool]:
    """The batch an offered rate or number of clients settles at (per replica), and
    whether the replica is overloaded (the rate needs more than `cap` or the budget)."""
    wl = ctx.workload

    def demand(b: int) -> float:  # requests decoding that the load asks for at batch b
        p = point(b)
        if p is None:
            return INF
        if wl.rate is not None:  # a request spends OSL steps in the batch
            return wl.rate / mix.dp * wl.osl * p.cycle
        clients = wl.concurrency / mix.dp
        return clients * wl.osl * p.cycle / (wl.osl * p.cycle + p.ttft)

    def settles(b: int) -> bool:  # the load keeps at least b requests decoding
        return point(b) is not None and demand(b) >= b

    batch = max(_largest(settles, cap), 1)
    wanted = demand(batch)
    if wanted < INF:
        batch = max(1, min(cap, math.ceil(wanted)))
    return batch, wanted > cap or point(batch) is None


def predict_prefill(ctx: Context, mix: Mix) -> Prediction:
    """A pool that only prefills: steps of `max_num_batched_tokens` prompt tokens; TTFT of
    one prompt, and the rate that keeps it within the SLO."""
    sessions, why = _memory(ctx, mix)
    if not sessions:
        return _unfit(mix, "prefill", why)
    wl, limits, pp = ctx.workload, ctx.limits, mix.pp
    chunk = min(limits.chunk, wl.new_tokens)
    alone = _step(ctx, mix, 0, chunk)  # one prompt (its ranks' share of a shared host)
    service = (cdiv(wl.new_tokens, chunk) + pp - 1) * alone.seconds
    # under load every micro-batch is a full budget: whole prompts packed, or one's chunk
    packed = max(1, limits.max_num_batched_tokens // wl.new_tokens)
    tokens = wl.new_tokens if packed > 1 else chunk
    full = _step(ctx, mix, 0, tokens, prompts=packed)
    capacity = packed * tokens / full.seconds / wl.new_tokens  # requests/s of one replica
    if wl.rate is None:
        rho = _rho_for(ctx.slo.ttft, service)
    else:
        rho = min(wl.rate / mix.dp / capacity, 1.0)
    ttft = service * (1 + rho / (2 * (1 - rho))) if rho < 1 else INF
    rate = rho * capacity * mix.dp
    return Prediction("prefill", mix, ttft, math.nan, rate * wl.new_tokens / mix.devices,
                      rate, 0, sessions, full.binding, ctx.slo.met(ttft, 0.0) and rho < 1, True,
                      "" if rho < 1 else "cannot sustain the offered load", service,
                      capacity * mix.dp)


def queued_ttft(prefill: Prediction, rate: float) -> float:
    """A prefill pool's TTFT when `rate` requests/s arrive: M/D/1 over its capacity."""
    rho = rate / prefill.capacity if prefill.capacity else 1.0
    return prefill.service_s * (1 + rho / (2 * (1 - rho))) if rho < 1 else INF


def _rho_for(ttft_slo: float | None, service: float) -> float:
    """The highest utilisation whose M/D/1 TTFT stays within the SLO (0.9 without one)."""
    if ttft_slo is None:
        return 0.9
    if service >= ttft_slo:
        return 0.0
    ratio = ttft_slo / service - 1  # rho / (2 (1 - rho)) <= ratio
    return min(0.98, 2 * ratio / (1 + 2 * ratio))


def predict_decode(ctx: Context, mix: Mix) -> Prediction:
    """A pool that only decodes (requests arrive with their KV): the largest batch within
    the TPOT SLO, the KV cache and `max_num_seqs`."""
    sessions, why = _memory(ctx, mix)
    if not sessions:
        return _unfit(mix, "decode", why)
    wl, slo, pp = ctx.workload, ctx.slo, mix.pp
    cap = min(ctx.limits.max_num_seqs, sessions)

    def tpot(b: int) -> float:
        return pp * _step(ctx, mix, cdiv(b, pp), 0).seconds

    batch = _largest(lambda b: slo.tpot is None or tpot(b) <= slo.tpot, cap) or 1
    step = _step(ctx, mix, cdiv(batch, pp), 0)
    t = pp * step.seconds
    binding = "KV capacity" if batch == sessions and sessions < ctx.limits.max_num_seqs else step.binding
    served = batch / t * mix.dp
    return Prediction("decode", mix, math.nan, t, served / mix.devices, served / wl.osl, batch,
                      sessions, binding, slo.tpot is None or t <= slo.tpot, True)


def decode_tpot(ctx: Context, mix: Mix, batch: int) -> float:
    """TPOT of a decode pool's replica with `batch` requests decoding."""
    return mix.pp * _step(ctx, mix, cdiv(max(batch, 1), mix.pp), 0).seconds


def _unfit(mix: Mix, role: str, why: str) -> Prediction:
    return Prediction(role, mix, INF, INF, 0.0, 0.0, 0, 0, "KV capacity", False, False, why)
