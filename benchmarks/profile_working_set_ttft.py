"""Where a working-set request's TTFT goes (issue 28): the engine in-process, driven with
the working-set benchmark's pattern (4 clients in a closed loop, 2,000-token contexts
re-read at random plus 8 new tokens, 16 output tokens), and each request's time from
arrival to first token cut into the phases the scheduler shows after every step:

- queued: waiting for admission (in `scheduler.waiting`);
- loading: admitted, its load in flight (`WAITING_FOR_KV`), from the step that sent
  the load until the step whose report ended it;
- to first token: running, until the step that samples its first token.

Per step it also records the wall time and what the step held (decodes, prompt
tokens, loads sent), so "queued" can be read against what the engine did meanwhile.

    python benchmarks/profile_working_set_ttft.py --pool-bytes 128MiB --host-bytes 128MiB \\
        --working-set 16000 --requests 60
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import time
from collections import defaultdict

from bench_working_set import CONTEXT, OUTPUT, SUFFIX, context

from tokenmill import SamplingParams
from tokenmill.engine.config import EngineArgs
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.request import RequestStatus
from tokenmill.kv_connector.registry import parse_size

CLIENTS = 4


def engine(args, disk: str) -> LLMEngine:
    extra = {}
    if args.host_bytes:
        extra = dict(kv_offload_host_bytes=args.host_bytes, kv_offload_disk_path=disk,
                     kv_offload_disk_bytes="16GiB")
    return LLMEngine(EngineArgs(kv_cache_memory_bytes=parse_size(args.pool_bytes, "pool"),
                                max_model_len=4096, dtype=args.dtype, **extra))


class JobTrace(logging.Handler):
    """The worker's `kv job` DEBUG lines: (kind, what, waited ms, ran ms)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.jobs: list[tuple[str, str, float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("kv job"):
            kind, what, waited, ran = record.args
            self.jobs.append((kind, str(what), waited, ran))


def jobs_summary(jobs) -> dict:
    out = {}
    for kind in sorted({j[0] for j in jobs}):
        mine = [j for j in jobs if j[0] == kind]
        out[kind] = {"n": len(mine), "mean_waited_ms": statistics.mean(j[2] for j in mine),
                     "mean_ran_ms": statistics.mean(j[3] for j in mine),
                     "total_ran_s": sum(j[3] for j in mine) / 1e3}
    return out


def run(args) -> dict:
    trace = JobTrace()
    worker_log = logging.getLogger("tokenmill.kv_connector.worker")
    worker_log.setLevel(logging.DEBUG)
    worker_log.addHandler(trace)
    worker_log.propagate = False
    params = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as disk:
        eng = engine(args, disk)
        sched = eng.scheduler
        n = max(2, args.working_set // CONTEXT)
        for i in range(n):  # warm: each context once
            eng.add_request(f"warm{i}", context(i) + [7], params)
            while eng.has_unfinished_requests():
                eng.step()
        trace.jobs.clear()
        rng = random.Random(args.seed)
        phase: dict[str, dict] = {}
        steps = []
        done = []
        ids = iter(range(10**9))

        def arrive():
            rid = f"r{next(ids)}"
            prompt = context(rng.randrange(n)) + [rng.randrange(1000, 40000) for _ in range(SUFFIX)]
            phase[rid] = {"arrived": time.perf_counter()}
            eng.add_request(rid, prompt, params)

        for _ in range(CLIENTS):
            arrive()
        started = time.perf_counter()
        while len(done) < args.requests:
            t0 = time.perf_counter()
            outs = eng.step()
            t1 = time.perf_counter()
            kinds = defaultdict(int)
            for rid, r in sched.requests.items():
                p = phase.get(rid)
                if p is None:
                    continue
                if r.status == RequestStatus.WAITING_FOR_KV and "load_sent" not in p:
                    p["load_sent"] = t1
                if r.status == RequestStatus.RUNNING and "running" not in p:
                    p["running"] = t1
                    p["computed_at_admit"] = r.num_computed_tokens
                kinds[r.status.name] += 1
                p["preemptions"] = r.num_preemptions
            steps.append({"t": t0 - started, "s": t1 - t0, **kinds})
            for out in outs:
                p = phase[out.request_id]
                if "first" not in p and out.outputs and out.outputs[0].token_ids:
                    p["first"] = t1
                if out.finished:
                    p["finished"] = t1
                    done.append(out.request_id)
                    arrive()
        elapsed = time.perf_counter() - started
        stats = eng.scheduler_stats()
        eng.shutdown()
    rows = []
    for rid in done:
        p = phase[rid]
        a = p["arrived"]
        admitted = p.get("load_sent", p.get("running"))
        rows.append({
            "ttft": p["first"] - a,
            "queued": admitted - a,
            "loading": (p["running"] - p["load_sent"]) if "load_sent" in p else 0.0,
            "to_first": p["first"] - p["running"],
            "loaded": "load_sent" in p,
            "computed_at_admit": p.get("computed_at_admit", 0),
            "preemptions": p.get("preemptions", 0),
        })
    summary = {k: statistics.mean(r[k] for r in rows) for k in ("ttft", "queued", "loading", "to_first")}
    step_s = [s["s"] for s in steps]
    return {"args": vars(args), "requests": len(rows), "elapsed_s": elapsed,
            "out_tok_s": len(rows) * OUTPUT / elapsed, "mean": summary,
            "loaded_fraction": sum(r["loaded"] for r in rows) / len(rows),
            "steps": len(steps), "mean_step_s": statistics.mean(step_s),
            "max_running": max(s.get("RUNNING", 0) for s in steps),
            "mean_running": statistics.mean(s.get("RUNNING", 0) for s in steps),
            "mean_waiting": statistics.mean(s.get("WAITING", 0) for s in steps),
            "preemptions": sum(r["preemptions"] for r in rows),
            "jobs": jobs_summary(trace.jobs),
            "loads": [j for j in trace.jobs if j[0] == "load"][:200],
            "rows": rows, "step_trace": steps[:400],
            "tiers": {k: v for k, v in (getattr(stats, "kv_tiers", None) or {}).items()}
            if isinstance(getattr(stats, "kv_tiers", None), dict) else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool-bytes", default="128MiB")
    p.add_argument("--host-bytes", default="128MiB", help="'' for no tiers")
    p.add_argument("--working-set", type=int, default=16000)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    result = run(args)
    brief = {k: v for k, v in result.items() if k not in ("rows", "step_trace", "loads")}
    print(json.dumps(brief, indent=1, default=str))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
