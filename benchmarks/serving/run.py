"""Serving benchmark: start each engine in turn, run the workloads against it, save JSON.

    python benchmarks/serving/run.py --engines tokenmill vllm transformers \
        --workloads sweep claude-code --repeats 3 --out benchmarks/serving/results/run.json
    python benchmarks/serving/run.py --engines tokenmill vllm llamacpp-bf16 \
        --workloads claude-code-capacity --out benchmarks/serving/results/capacity.json

Engines run one at a time on 127.0.0.1 with the same model and thread count; every
workload point is preceded by the engine's warm-up, repeated `--repeats` times, and the
summaries are saved per repeat (report.py takes medians and ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import platform
import shutil
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import engines
from capacity import judge_point, max_sessions_at_slo
from reuse import reuse_summary, seen_prefix_words, turn_reuse, working_set_tokens

from tokenmill.server.bench import workloads as wl
from tokenmill.server.bench.loadgen import Session, Target, run_workload
from tokenmill.server.bench.stats import Slo, summarize

log = logging.getLogger("serving-bench")
TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
SWEEP = {1: 3, 4: 8, 16: 32, 64: 64}  # concurrency: requests sent
CAPACITY = "claude-code-capacity"  # run by run_capacity, not points()
REPLAYS = ("claude-code", CAPACITY)  # completion-style replays: per-turn prefix reuse
PER_REQUEST = (*REPLAYS, "mooncake", "multi-turn", "shared-prefix")  # runs keep every request


def points(name: str, words: wl.Words, args) -> list[tuple[str, list[Session], int | None, float]]:
    """(point label, sessions, max concurrency, hard time limit s) for one workload name."""
    if name == "smoke":
        return [("4x(32in,16out)", wl.uniform(words, 4, 32, 16, tag="smoke"), 4, args.point_limit_s)]
    if name == "offline-uniform":
        return [("64x(128in,128out)", wl.uniform(words, 64, 128, 128), None, args.point_limit_s)]
    if name == "offline-mixed":
        return [("48 mixed", wl.mixed(words, 48), None, args.point_limit_s)]
    if name == "sweep":
        return [(f"c={c}", wl.uniform(words, n, 256, 128, tag=f"s{c}-"), c, args.point_limit_s)
                for c, n in SWEEP.items() if c in args.sweep_concurrency]
    if name == "shared-prefix":
        return [("32 req, 4 groups, 1024 shared + 64", wl.shared_prefix(words, 32, 4, 1024, 64, 32), 8,
                 args.point_limit_s)]
    if name == "multi-turn":
        return [("8 sessions x 4 turns", wl.multi_turn(words, 8, 4, 512, 64, 64, 0.5), None,
                 args.point_limit_s)]
    if name == "claude-code":
        f = args.trace_factor
        s = wl.claude_code(words, TRACES / "claude-code", f, f, args.trace_sessions, args.max_model_len,
                           stagger_s=args.trace_stagger_s)
        return [(f"{len(s)} sessions, /{f}", s, None, args.trace_limit_s)]
    if name == "mooncake":
        f = args.mooncake_factor
        s = wl.mooncake(words, TRACES / "mooncake" / "conversation_trace.jsonl", f,
                        args.mooncake_time_factor, args.mooncake_requests, args.max_model_len)
        return [(f"{len(s)} requests, /{f}, time /{args.mooncake_time_factor:g}", s, None,
                 args.trace_limit_s)]
    raise ValueError(f"unknown workload {name!r}")


def warm_up(target: Target, words: wl.Words) -> None:
    asyncio.run(run_workload(target, wl.uniform(words, 4, 64, 16, tag="warm"), 4, 120, 300))


def run_point(spec: engines.EngineSpec, target: Target, workload: str, label: str,
              sessions: list[Session], conc: int | None, limit: float, rep: int, args) -> dict:
    """Run one workload point once; the run's JSON record (summary, per-request rows for the
    trace-like workloads, per-turn prefix reuse for the completion-style replays)."""
    salted = ("tokenmill", "tokenmill-offload", "tokenmill-fp8kv", "vllm")
    salt = {"cache_salt": f"{time.time_ns()}"} if spec.name in salted else {}
    # a fresh salt per repeat keeps one repeat's prefix cache from serving the next
    t = Target(target.base_url, target.model, {**target.extra_body, **salt})
    results, dur = asyncio.run(run_workload(t, sessions, conc, limit, limit + 30))
    summary = summarize(results, dur, Slo(args.slo_ttft_s, args.slo_tpot_s))
    run = {"workload": workload, "point": label, "concurrency": conc, "repeat": rep,
           "summary": summary}
    if workload in PER_REQUEST:
        reqs = [{k: v for k, v in asdict(r).items() if k not in ("itls", "text")}
                for r in sorted(results, key=lambda r: (r.session, r.turn))]
        if workload in REPLAYS:
            prompts = {(s.name, i): turn.prompt for s in sessions for i, turn in enumerate(s.turns)}
            for r, seen in zip(reqs, seen_prefix_words(reqs, prompts)):
                r["seen_prefix_words"] = seen
            sent = {(r["session"], r["turn"]) for r in reqs if r["start"] == r["start"]}  # not NaN
            run["working_set_tokens"] = working_set_tokens(
                [p for key, p in prompts.items() if key in sent])
            turns = turn_reuse(reqs)
            run["reuse"] = (reuse_summary(turns, spec.kv_block_size)
                            if turns is not None and spec.kv_block_size else None)
        run["requests"] = reqs
    errors = sorted({r.error for r in results if r.error})[:3]
    if errors:
        run["errors"] = errors
    log.info("%s %s %s rep %d: %.1f out tok/s, ttft p50 %.0f ms, %d/%d ok %s", spec.name, workload,
             label, rep, summary["output_tok_per_s"], summary["ttft_p50_ms"],
             summary["requests"] - summary["failed"], summary["requests"], errors)
    time.sleep(2)  # let cancelled work drain
    return run


def run_capacity(spec: engines.EngineSpec, target: Target, args,
                 words: wl.Words) -> tuple[list[dict], dict]:
    """The Claude Code replay at each --capacity-sessions count, smallest first, until a count
    fails the TTFT SLO or has failed requests; the runs and the engine's capacity record."""
    runs, verdicts = [], []
    f = args.trace_factor
    for n in sorted(args.capacity_sessions):
        sessions = wl.claude_code_slots(words, TRACES / "claude-code", f, f, n,
                                        args.capacity_window_s, args.capacity_ramp_s,
                                        args.max_model_len)
        label = f"{n} session{'s' if n > 1 else ''}"
        for rep in range(args.trace_repeats):
            run = run_point(spec, target, CAPACITY, label, sessions, None, args.capacity_window_s,
                            rep, args)
            ttfts = [r["ttft"] for r in run["requests"] if r["ok"]]
            v = judge_point(n, ttfts, run["summary"]["failed"], args.slo_ttft_s,
                            args.capacity_percentile)
            run["capacity"] = {**asdict(v), "slo_ttft_s": args.slo_ttft_s,
                               "percentile": args.capacity_percentile}
            runs.append(run)
            verdicts.append(v)
        if not all(v.passed for v in verdicts if v.sessions == n):
            log.info("%s: %d sessions fail the SLO (%s); no larger count is run", spec.name, n,
                     "; ".join(v.reason for v in verdicts if v.sessions == n and not v.passed))
            break
    best, every = max_sessions_at_slo(verdicts)
    return runs, {"slo_ttft_s": args.slo_ttft_s, "percentile": args.capacity_percentile,
                  "window_s": args.capacity_window_s, "ramp_s": args.capacity_ramp_s,
                  "max_sessions": best, "every_point_passed": every,
                  "points": [asdict(v) for v in verdicts]}


def run_engine(spec: engines.EngineSpec, args, words: wl.Words) -> dict:
    out = {"version": engines.version(spec), "argv": spec.argv, "env": spec.env,
           "kv_block_size": spec.kv_block_size, "runs": []}
    log_path = Path(args.log_dir) / f"{spec.name}.log"
    with engines.EngineProcess(spec, args.port, log_path) as proc:
        out["startup_s"] = proc.startup_s
        target = Target(f"http://127.0.0.1:{args.port}", engines.SERVED, dict(spec.extra_body))
        warm_up(target, words)
        for workload in args.workloads:
            if workload == CAPACITY:
                runs, out["capacity"] = run_capacity(spec, target, args, words)
                out["runs"] += runs
                continue
            for label, sessions, conc, limit in points(workload, words, args):
                for rep in range(args.repeats if workload in args.repeated else args.trace_repeats):
                    out["runs"].append(run_point(spec, target, workload, label, sessions, conc,
                                                 limit, rep, args))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", nargs="+", default=["tokenmill", "vllm", "transformers",
                                                    "llamacpp-bf16", "llamacpp-q4_1"])
    p.add_argument("--workloads", nargs="+", default=["sweep"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--repeated", nargs="+", default=["sweep", "smoke"],
                   help="workloads run --repeats times; the others run --trace-repeats times")
    p.add_argument("--trace-repeats", type=int, default=1)
    p.add_argument("--sweep-concurrency", nargs="+", type=int, default=list(SWEEP),
                   choices=list(SWEEP), help="sweep: the concurrency points to run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--point-limit-s", type=float, default=90.0)
    p.add_argument("--trace-limit-s", type=float, default=120.0)
    p.add_argument("--trace-factor", type=int, default=32)
    p.add_argument("--trace-sessions", type=int, default=6)
    p.add_argument("--trace-stagger-s", type=float, default=5.0)
    p.add_argument("--mooncake-requests", type=int, default=60)
    # 512 / 32 = 16-token blocks: as large as the engines' KV blocks, so shared blocks can hit
    p.add_argument("--mooncake-factor", type=int, default=32)
    p.add_argument("--mooncake-time-factor", type=float, default=0.5,
                   help="arrival times are divided by this (0.5: twice as slow as recorded)")
    p.add_argument("--capacity-sessions", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32],
                   help=f"{CAPACITY}: concurrent replayed sessions, one point each, run until one fails")
    p.add_argument("--capacity-window-s", type=float, default=40.0,
                   help=f"{CAPACITY}: no turn starts after this; slots start within --capacity-ramp-s")
    p.add_argument("--capacity-ramp-s", type=float, default=5.0)
    p.add_argument("--capacity-percentile", type=float, default=90.0,
                   help=f"{CAPACITY}: this percentile of TTFT over all turns must be <= --slo-ttft-s")
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.1)
    p.add_argument("--engine-args", nargs="+", default=[], metavar="ENGINE=ARGS",
                   help='extra command-line arguments for an engine, e.g. '
                        '"vllm=--max-num-batched-tokens 512" (recorded in the results)')
    p.add_argument("--kv-pool-bytes", type=int, default=None,
                   help="device KV pool of tokenmill and vLLM, in bytes (both engines' "
                        "--kv-cache-memory-bytes); adds the engines tokenmill-offload and "
                        "tokenmill-fp8kv (an FP8 KV cache in the same bytes)")
    p.add_argument("--offload-host-bytes", default="3GiB",
                   help="tokenmill-offload: host tier size (with --kv-pool-bytes)")
    p.add_argument("--offload-disk-path", default=None,
                   help="tokenmill-offload: disk tier directory (emptied at start); none: host only")
    p.add_argument("--offload-disk-bytes", default="16GiB")
    p.add_argument("--out", default="benchmarks/serving/results/run.json")
    p.add_argument("--log-dir", default=str(engines.PEERS / "logs"))
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the engine under test is stopped with the harness
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    words = wl.Words(wl.one_token_words(engines.HF_DIR / "tokenizer.json"))
    specs = engines.engine_specs(args.port, args.threads, args.max_model_len)
    if args.kv_pool_bytes is not None:
        if args.offload_disk_path:
            shutil.rmtree(args.offload_disk_path, ignore_errors=True)  # no earlier run's KV
        specs = engines.with_kv_pool(specs, args.kv_pool_bytes, args.offload_host_bytes,
                                     args.offload_disk_path, args.offload_disk_bytes)
    for item in args.engine_args:
        name, sep, extra = item.partition("=")
        if not sep or name not in specs:
            p.error(f"--engine-args {item!r}: expected ENGINE=ARGS with ENGINE one of {sorted(specs)}")
        specs[name] = dataclasses.replace(specs[name], argv=[*specs[name].argv, *extra.split()])
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()},
              "args": vars(args), "engines": {}}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for name in args.engines:
        spec = specs[name]
        ok, why = engines.available(spec)
        if not ok:
            log.warning("skipping %s: %s", name, why)
            report["engines"][name] = {"skipped": why}
            continue
        try:
            report["engines"][name] = run_engine(spec, args, words)
        except (RuntimeError, TimeoutError) as e:
            log.error("%s failed: %s", name, e)
            report["engines"][name] = {"failed": str(e)}
        out_path.write_text(json.dumps(report, indent=1, default=float))
    log.info("wrote %s", out_path)


if __name__ == "__main__":
    main()
