"""`tokenmill plan --calibrate`: measure the kernels the performance model predicts on this
machine, through the active plugin, and store the efficiency factors.

1. Kernels in this process (`kernel_bench`): GEMMs of several widths, every attention kind
   on the backend the engine would pick, recurrent scans, MoE experts, a norm. Per op
   class, a latency (the time of a tiny call less its roofline time), then a compute
   efficiency from its compute-bound points and a memory efficiency from its memory-bound
   ones (the roofline at full efficiency over the time taken less the latency); the GEMM
   tile width W from how narrow GEMMs fall behind.
2. For each group size n: n processes join a process group as an engine's ranks do and
   time every collective at five sizes (fit: latency per step and bandwidth, per op);
   on a shared host (cpu) they run the kernels at once too, giving the efficiency of one
   rank's share of the machine when n ranks compete for it.
3. Host overhead: a tiny llama (hidden 64) decoding through the engine with 2 and 8
   layers gives the time of a step beyond its kernels (their latencies, as fitted in 1.)
   and of each layer; with 2 ranks
   (tensor parallel over "mp" processes), again at 2 and 8 layers, the extra per step of
   worker processes and per layer of a tensor-parallel step (all-reduce waits beyond the
   collective fit: on a shared host, ranks that each own a core wake each other).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from tokenmill.planner.calibration import (
    DEFAULTS,
    Calibration,
    Efficiency,
    LinkFit,
    Peaks,
    default_path,
    save,
)

_WIDTHS = (8, 16, 32, 64, 128, 256, 512, 1024)


def calibrate(platform: str | None = None, ranks: tuple[int, ...] = (1, 2), quick: bool = False,
              progress: TextIO | None = None, path: Path | None = None,
              dtype: str | None = None) -> tuple[Calibration, Path]:
    """Measure, fit and store; returns the calibration and where it went. `dtype`: the
    kernels' (None: the platform's default); stored per device and dtype, since a device
    may run one dtype's kernels several times slower than another's."""
    import torch

    from tokenmill.planner.kernel_bench import all_points, point_dict
    from tokenmill.platforms.registry import load_platform

    def say(text: str) -> None:
        if progress is not None:
            print(f"calibrate: {text}", file=progress, flush=True)

    active = load_platform(platform)
    spec = active.hardware_spec()
    dtype = dtype or str(active.platform.default_dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"calibration dtype {dtype!r} is not a torch dtype")
    peak = spec.peak_flops.get(dtype) or max(spec.peak_flops.values())
    shared = active.platform.device_type == "cpu"
    say(f"kernels on {spec.name} ({active.name}, {dtype})")
    local = [point_dict(p) for p in all_points(active, quick, getattr(torch, dtype))]
    width = fit_width([p for p in local if p["op"] == "gemm" and not p.get("latency")], peak)
    efficiency, latency = fit_latency(local, peak, spec.memory_bandwidth, width)
    measured: dict = {"points": {"1": local}}
    per_ranks: dict[int, dict[str, Efficiency]] = {}
    collectives: dict[int, dict[str, LinkFit]] = {}
    for n in sorted(r for r in ranks if r > 1):
        say(f"a group of {n} ranks: collectives" + (" and kernels side by side" if shared else ""))
        group = run_group(n, active.name, quick, kernels=shared, dtype=dtype)
        collectives[n] = fit_collectives(group["collectives"], n)
        measured[f"collectives_{n}"] = group["collectives"]
        if shared:
            measured["points"][str(n)] = group["points"]
            per_ranks[n] = fit_efficiency(group["points"], peak / n, spec.memory_bandwidth / n,
                                          width, latency)
    if shared:
        per_ranks[1] = efficiency
    cal = Calibration(device=spec.name, platform=active.name, efficiency=efficiency,
                      per_ranks=per_ranks, latency=latency, collectives=collectives, gemm_width=width,
                      measured=measured, fitted_to=Peaks.of(spec, dtype))
    say("host overhead of engine steps (tiny llama, 2 and 8 layers)")
    fields = measure_overheads(active.name, cal, 2 in ranks, dtype, spec, shared)
    probe = fields.pop("probe")
    cal = replace(cal, measured=cal.measured | {"engine_probe": probe}, **fields)
    target = path or default_path(spec.name, dtype)
    return cal, save(cal, target)


def _shape(inner: int, outer: int, width: float) -> float:
    return Calibration(gemm_width=width).shape_factor(inner, outer)


def fit_width(points: list[dict], peak: float) -> float:
    """The tile width W that best explains how narrow GEMMs fall behind wide ones: the
    spread (log) of the compute-bound GEMMs' efficiencies after the shape factor."""
    compute = [p for p in points if p["flops"] / peak > p["bytes"] / 1e12 and p["inner"] > 1]
    big = [p for p in compute if p["flops"] > 1e8]
    if len(big) < 2:
        return 128.0

    def spread(w: float) -> float:
        logs = [math.log(p["flops"] / peak / _shape(p["inner"], p["outer"], w) / p["seconds"])
                for p in big]
        return statistics.pvariance(logs)

    return float(min(_WIDTHS, key=spread))


def _roofline(p: dict, eff: Efficiency, peak: float, bandwidth: float, width: float) -> float:
    return max(p["flops"] / (peak * eff.compute * _shape(p["inner"], p["outer"], width)),
               p["bytes"] / (bandwidth * eff.memory))


def fit_latency(points: list[dict], peak: float, bandwidth: float,
                width: float) -> tuple[dict[str, Efficiency], dict[str, float]]:
    """(efficiencies, latencies) per op class: a class's latency is its tiny point's time
    less that point's roofline time, the efficiencies are fitted on the other points less
    the latency; twice over, each with the other's last fit (the tiny points' roofline
    time is small, so this settles at once)."""
    latency: dict[str, float] = {}
    tiny = {p["op"]: p for p in points if p.get("latency")}
    efficiency = fit_efficiency(points, peak, bandwidth, width, latency)
    for _ in range(2):
        latency = {op: max(p["seconds"] - _roofline(p, efficiency[op], peak, bandwidth, width), 0.0)
                   for op, p in tiny.items() if op in efficiency}
        efficiency = fit_efficiency(points, peak, bandwidth, width, latency)
    return efficiency, latency


def fit_efficiency(points: list[dict], peak: float, bandwidth: float,
                   width: float, latency: dict[str, float] | None = None) -> dict[str, Efficiency]:
    """Per op class: the median compute efficiency of its compute-bound points and the
    median memory efficiency of its memory-bound ones (which bound is decided with the
    fitted efficiencies, twice over), each point's time less its class's `latency` (tiny
    points, which measure the latency, are left out). A class measured on one side only
    keeps the default ratio between the two."""
    latency = latency or {}
    out: dict[str, Efficiency] = {}
    for op in sorted({p["op"] for p in points if not p.get("latency")}):
        mine = [p for p in points if p["op"] == op and not p.get("latency")]
        eff = DEFAULTS.get(op, DEFAULTS["gemm"])
        for _ in range(2):
            compute, memory = [], []
            for p in mine:
                tc = p["flops"] / (peak * _shape(p["inner"], p["outer"], width))
                tm = p["bytes"] / bandwidth
                # never below half the time taken: a latency measured high cannot make a
                # big point's kernel look twice as fast as it ran
                seconds = max(p["seconds"] - latency.get(op, 0.0), p["seconds"] / 2)
                if tc / eff.compute >= tm / eff.memory:
                    compute.append(tc / seconds)
                else:
                    memory.append(tm / seconds)
            ratio = eff.memory / eff.compute
            c = statistics.median(compute) if compute else statistics.median(memory) / ratio
            m = statistics.median(memory) if memory else statistics.median(compute) * ratio
            eff = Efficiency(c, m)
        out[op] = eff
    return out


def fit_collectives(timings: dict[str, dict[str, float]], n: int) -> dict[str, LinkFit]:
    """Least squares of t = a + b S per op (a: the call's latency, S the payload), turned
    into the model's terms: latency per step = a / (passes x hops), bandwidth = passes x
    (n - 1) / n / b."""
    from tokenmill.planner.collectives import _STEPS

    fits = {}
    hops = max(1, math.ceil(math.log2(n)))
    for op, by_size in timings.items():
        sizes = [float(s) for s in by_size]
        times = [by_size[s] for s in by_size]
        mean_s, mean_t = statistics.fmean(sizes), statistics.fmean(times)
        var = sum((s - mean_s) ** 2 for s in sizes)
        slope = max(sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, times)) / var, 1e-15)
        intercept = max(mean_t - slope * mean_s, 1e-7)
        if op == "send":
            fits[op] = LinkFit(intercept, 1.0 / slope)
        else:
            passes = _STEPS[op]
            fits[op] = LinkFit(intercept / (passes * hops), passes * (n - 1) / n / slope)
    return fits


def run_group(n: int, platform: str, quick: bool, kernels: bool = True,
              dtype: str | None = None) -> dict:
    """Run `group_bench` on n ranks (processes of their own) and return rank 0's results
    (`kernels`: also the kernels, every rank at once)."""
    from tokenmill.distributed.rendezvous import free_loopback_init_method

    init = free_loopback_init_method()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(n):
            cmd = [sys.executable, "-m", "tokenmill.planner.group_bench", "--rank", str(rank),
                   "--world", str(n), "--init-method", init, "--platform", platform,
                   "--out", str(Path(tmp) / f"{rank}.json")] + (["--quick"] if quick else []) + (
                       [] if kernels else ["--no-kernels"]) + (["--dtype", dtype] if dtype else [])
            procs.append(subprocess.Popen(cmd))
        codes = [p.wait(timeout=3600) for p in procs]
        if any(codes):
            raise RuntimeError(f"calibration group of {n} ranks failed: exit codes {codes}")
        return json.loads((Path(tmp) / "0.json").read_text())


def measure_overheads(platform: str, cal: Calibration, with_ranks: bool,
                      dtype: str = "float32", spec=None,
                      shared_host: bool = False) -> dict[str, float]:
    """step_overhead_s, layer_overhead_s, rank_overhead_s, tp_layer_overhead_s,
    pp_stage_overhead_s and layer_extra_s (and `probe`: the steps measured, kernels taken
    off) from decode steps of tiny llamas through the engine (2 and 8
    layers, tp1 and tp2; 8 layers at pp2), less what the model predicts for their kernels
    (with `cal`'s latencies; `spec`: the device's, None: kernels taken as free;
    `shared_host`: ranks split it) and collectives."""
    from tokenmill.planner.engine_probe import KINDS, decode_step_seconds

    with tempfile.TemporaryDirectory() as tmp:
        def step(layers: int, tp: int = 1, pp: int = 1, kind: str = "dense") -> float:
            seconds = decode_step_seconds(Path(tmp), platform, layers=layers, dtype=dtype,
                                          tensor_parallel=tp, pipeline_parallel=pp,
                                          kind=kind)
            if spec is None:
                return seconds
            kernels = tiny_kernels_s(cal, spec, Path(tmp), layers, dtype, tp, pp, shared_host,
                                     kind)
            return max(seconds - kernels, 0.0)

        two, eight = step(2), step(8)
        kinds = {kind: step(8, kind=kind) for kind in KINDS if kind != "dense"}
        tp2 = tp8 = pp8 = None
        if with_ranks:
            # ranks of their own on a shared host vary from one start to the next (how the
            # OS places them): the best of three starts each
            def best(**kw) -> float:
                return min(step(**kw) for _ in range(3))

            tp2 = best(layers=2, tp=2)
            tp8 = best(layers=8, tp=2)
            pp8 = best(layers=8, pp=2)
    fit = cal.collective_fit("all_reduce", 2)  # tiny payloads: an all-reduce is 2 latencies
    send = cal.collective_fit("send", 2)
    fitted = overheads_from_steps(two, eight, tp2, tp8, 2 * fit.latency if fit else 0.0,
                                  cal.rank_overhead_s, pp_eight=pp8,
                                  send_latency_s=send.latency if send else 0.0)
    extras = layer_extras(fitted["step_overhead_s"], fitted["layer_overhead_s"], kinds, 8)
    # the steps, kernels taken off, for the record (a refit needs them)
    probe = {"two": two, "eight": eight, "tp_two": tp2, "tp_eight": tp8, "pp_eight": pp8,
             "eight_of_kind": kinds}
    return fitted | {"layer_extra_s": extras, "probe": probe}


def layer_extras(step_s: float, layer_s: float, kinds: dict[str, float],
                 layers: int) -> dict[str, float]:
    """What a layer of each kind costs beyond a llama layer (`layer_s`), from the decode
    steps (kernels taken off) of tiny models of `layers` layers all of that kind: "moe"
    (attention + routed experts), "gated_delta" (Gated DeltaNet + Qwen3-Next's experts:
    the experts' part is "moe"'s), "mamba2" (Mamba2 + an MLP)."""
    per = {kind: max((t - step_s) / layers - layer_s, 0.0) for kind, t in kinds.items()}
    extras = dict(per)
    if "gated_delta" in per:
        extras["gated_delta"] = max(per["gated_delta"] - per.get("moe", 0.0), 0.0)
    return extras


def tiny_kernels_s(cal: Calibration, spec, root: Path, layers: int, dtype: str, tp: int = 1,
                   pp: int = 1, shared_host: bool = False, kind: str = "dense") -> float:
    """The kernels' time the model predicts for a decode step of the probe's tiny model
    (one sequence; at pp > 1 a token's interval: every stage's step), collectives and
    overheads left out: at hidden 64 this is the op classes' latencies."""
    import torch

    from tokenmill.planner.catalog import model_shape
    from tokenmill.planner.engine_probe import tiny_model
    from tokenmill.planner.mixes import Mix
    from tokenmill.planner.ops import Seq
    from tokenmill.planner.step import Share, op_seconds, stage_costs

    model = model_shape(str(tiny_model(root, layers, kind)), getattr(torch, dtype))
    mix = Mix(tp=tp, pp=pp)
    n = tp * pp if shared_host else 1
    peak = spec.peak_flops.get(dtype) or max(spec.peak_flops.values())
    share = Share(peak / n, spec.memory_bandwidth / n, n)
    return sum(op_seconds(c, share, cal)[0]
               for stage in range(pp)
               for c in stage_costs(model, mix, (Seq(20, 1),), 1, stage))


def overheads_from_steps(two: float, eight: float, tp_two: float | None,
                         tp_eight: float | None, reduce_latency_s: float,
                         rank_default_s: float, pp_eight: float | None = None,
                         send_latency_s: float = 0.0) -> dict[str, float]:
    """The overheads from decode-step seconds of 2- and 8-layer tiny llamas at tp1 (`two`,
    `eight`) and tp2 (`tp_two`, `tp_eight`; None: not measured, the rank figures keep
    `rank_default_s` and 0). A tp layer all-reduces twice (attention out, MLP down),
    a step once more for the logits; their fitted latency is the link's, the rest is
    overhead: per layer of a tp step, and per step. `reduce_latency_s`: one all-reduce of
    a tiny payload on 2 ranks, as the collective fit predicts it. `pp_eight`: a token's
    interval of the 8-layer llama at pp2 with the pipeline full (None: not measured, no
    stage overhead): two stages of 4 layers, each with the step's costs and a send
    (`send_latency_s`); what is left is the stage hand-over (on a shared host also the
    stages' processes and the engine's competing for the cores). The rank overhead is a
    step's whose ranks wait on each other in collectives (tp, and the context-parallel
    dims): a pipeline's stages do not, and pay their hand-over instead (with the 2-rank
    tp probe's 12.9 ms a step charged to pp2's stages too, run 9 predicted Qwen3 small's
    pp2 TPOT 2.7x what it measured, docs/planner.md)."""
    per_layer = max((eight - two) / 6, 0.0)
    step = max(two - 2 * per_layer, 1e-5)
    rank, tp_layer = rank_default_s, 0.0
    if tp_two is not None and tp_eight is not None:
        tp_layer = max((tp_eight - tp_two) / 6 - per_layer - 2 * reduce_latency_s, 0.0)
        reduces = (2 * 2 + 1) * reduce_latency_s
        rank = max(tp_two - two - reduces - 2 * tp_layer, 0.0)
    stage = 0.0
    if pp_eight is not None:
        stage = max(pp_eight / 2 - step - 4 * per_layer - send_latency_s, 0.0)
    return {"step_overhead_s": step, "layer_overhead_s": per_layer, "rank_overhead_s": rank,
            "tp_layer_overhead_s": tp_layer, "pp_stage_overhead_s": stage}
