"""How busy each process of a multi-process engine is while it decodes: the engine process
(scheduler, output processing; for tp1 also the model) and each worker rank, as CPU
seconds per wall second over decode steps with every micro-batch full.

On a shared host the ranks split the cores; the planner prices a rank's compute at the
host over the busy processes. Whether the engine process counts as one depends on whether
it works while the ranks compute: a synchronous step (tp, dcp, pcp) waits for them, a
pipelined one (pp) schedules and collects the next micro-batch meanwhile.

Usage: python benchmarks/probe_pp_cpu_share.py [--mixes tp1,tp2,pp2] [--batch 2] [--steps 48]
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_planner import engine_kwargs, mix_of, small_model  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def descendants(pid: int) -> list[int]:
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):  # a process that ended meanwhile
            continue
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        children = [c for c, pp in parent.items() if pp == p]
        found += children
        todo += children
    return sorted(found)


def probe(path: str, label: str, batch: int, steps: int, isl: int) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(path, platform="cpu", dtype="bfloat16", enable_prefix_caching=False,
              max_num_seqs=8, **engine_kwargs(mix_of(label)))
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", [10 + (7 * i + j) % 200 for j in range(isl)], params)
        for _ in range(8):  # the prompts, and the pipeline filling
            engine.step()
        pids = [os.getpid()] + descendants(os.getpid())
        before = {p: cpu_seconds(p) for p in pids}
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
        used = {p: cpu_seconds(p) - before[p] for p in pids}
    finally:
        engine.shutdown()
    return {"wall": wall, "step_ms": wall / steps * 1e3,
            "busy": [used[p] / wall for p in pids]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--mixes", default="tp1,tp2,pp2")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--isl", type=int, default=128)
    args = parser.parse_args()
    path = str(small_model(Path(tempfile.mkdtemp()), args.arch))
    print(f"{args.arch} small, batch {args.batch}, {args.steps} decode steps; CPU s per wall s: "
          "engine process first, then its descendants (workers)")
    print("| mix | step ms | engine | workers | sum |")
    print("|---|---:|---:|---|---:|")
    for label in args.mixes.split(","):
        r = probe(path, label, args.batch, args.steps, args.isl)
        workers = " / ".join(f"{b:.2f}" for b in r["busy"][1:] if b >= 0.01) or "-"
        print(f"| {label} | {r['step_ms']:.1f} | {r['busy'][0]:.2f} | {workers} | "
              f"{sum(r['busy']):.2f} |", flush=True)


if __name__ == "__main__":
    main()
