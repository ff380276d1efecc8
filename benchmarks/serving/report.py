"""Tables (markdown) and a throughput-vs-concurrency plot from run.py's JSON files.

    python benchmarks/serving/report.py benchmarks/serving/results/*.json \
        --plot docs/benchmarks-peers-sweep.png > /tmp/tables.md

Later files override earlier ones for the same engine and workload. Figures are medians
over repeats; ratios are tokenmill / peer, pair by pair.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from dataclasses import fields
from pathlib import Path

from capacity import PointVerdict, max_sessions_at_slo
from run import CAPACITY, PER_REQUEST, REPLAYS

from tokenmill.server.bench.stats import median

ORDER = ["tokenmill", "vllm", "transformers", "llamacpp-bf16", "llamacpp-q4_1"]


def load(paths: list[Path]) -> tuple[dict, dict]:
    """{engine: {(workload, point): [summary per repeat]}}, {engine: meta}."""
    runs: dict = defaultdict(dict)
    meta: dict = {}
    for path in paths:
        data = json.loads(path.read_text())
        for engine, info in data["engines"].items():
            if "runs" not in info:
                meta.setdefault(engine, info)
                continue
            meta[engine] = {k: v for k, v in info.items() if k != "runs"}
            fresh = defaultdict(list)
            for run in info["runs"]:
                fresh[(run["workload"], run["point"])].append(run)
            runs[engine].update(fresh)
    return runs, meta


def med(rs: list[dict], key: str) -> float:
    return median([r["summary"][key] for r in rs])


def fmt(x: float, nd: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def engines_in(runs: dict) -> list[str]:
    return [e for e in ORDER if e in runs] + [e for e in runs if e not in ORDER]


def table(runs: dict, workload: str) -> str:
    cols = ["output tok/s", "req/s", "goodput req/s", "TTFT p50/p90/p99 ms", "ITL p50/p99 ms",
            "TPOT p50 ms", "E2E p50/p99 ms", "ok/sent", "n"]
    lines = [f"| engine | point | {' | '.join(cols)} |", "|" + "---|" * (len(cols) + 2)]
    for engine in engines_in(runs):
        for (w, point), rs in sorted(runs[engine].items(), key=lambda kv: _point_key(kv[0][1])):
            if w != workload:
                continue
            s = rs[0]["summary"]
            ok = median([r["summary"]["requests"] - r["summary"]["failed"] for r in rs])
            lines.append(
                f"| {engine} | {point} | {fmt(med(rs, 'output_tok_per_s'))} | {fmt(med(rs, 'req_per_s'), 2)} | "
                f"{fmt(med(rs, 'goodput_req_per_s'), 2)} | {fmt(med(rs, 'ttft_p50_ms'), 0)} / "
                f"{fmt(med(rs, 'ttft_p90_ms'), 0)} / {fmt(med(rs, 'ttft_p99_ms'), 0)} | "
                f"{fmt(med(rs, 'itl_p50_ms'), 0)} / {fmt(med(rs, 'itl_p99_ms'), 0)} | "
                f"{fmt(med(rs, 'tpot_p50_ms'), 0)} | {fmt(med(rs, 'e2e_p50_ms'), 0)} / "
                f"{fmt(med(rs, 'e2e_p99_ms'), 0)} | {fmt(ok, 0)}/{s['requests']} | {len(rs)} |")
    return "\n".join(lines)


def _point_key(point: str):
    m = re.match(r"(?:c=)?(\d+)", point)  # "c=16", "8 sessions": by the number
    return (0, int(m.group(1)), point) if m else (1, 0, point)


def ratios(runs: dict, workload: str, key: str = "output_tok_per_s", base: str = "tokenmill") -> str:
    if base not in runs:
        return ""
    peers = [e for e in engines_in(runs) if e != base]
    if not peers:
        return ""
    lines = [f"| point | {' | '.join(f'{base} / {p}' for p in peers)} |", "|" + "---|" * (len(peers) + 1)]
    for (w, point), rs in sorted(runs[base].items(), key=lambda kv: _point_key(kv[0][1])):
        if w != workload:
            continue
        cells = []
        for p in peers:
            other = runs[p].get((w, point))
            cells.append(f"{med(rs, key) / med(other, key):.2f}x" if other and med(other, key) else "-")
        lines.append(f"| {point} | {' | '.join(cells)} |")
    return "\n".join(lines)


def trace_table(runs: dict, workload: str) -> str:
    """Per-turn prompt tokens sent vs computed (sent - cached, where the engine reports it)."""
    lines = ["| engine | requests ok | prompt tokens sent | cached (reported) | computed | "
             "TTFT p50 / p90 ms | turn>0 TTFT p50 ms |", "|---|---|---|---|---|---|---|"]
    for engine in engines_in(runs):
        for (w, _point), rs in runs[engine].items():
            if w != workload:
                continue
            reqs = [q for q in rs[0].get("requests", []) if q["ok"]]
            sent = sum(q["prompt_tokens"] for q in reqs)
            cached_l = [q["cached_tokens"] for q in reqs if q["cached_tokens"] is not None]
            cached = sum(cached_l) if cached_l else None
            later = sorted(q["ttft"] for q in reqs if q["turn"] > 0)
            s = rs[0]["summary"]
            lines.append(
                f"| {engine} | {len(reqs)}/{s['requests']} | {sent} | "
                f"{'not exposed' if cached is None else cached} | "
                f"{'-' if cached is None else sent - cached} | {fmt(s['ttft_p50_ms'], 0)} / "
                f"{fmt(s['ttft_p90_ms'], 0)} | {fmt(median(later) * 1000, 0) if later else '-'} |")
    return "\n".join(lines)


def capacity_table(runs: dict) -> str:
    """Per engine: the most concurrent replayed sessions within the TTFT SLO, and each point."""
    names = {f.name for f in fields(PointVerdict)}
    verdicts: dict[str, list[tuple[PointVerdict, dict]]] = {}
    for engine in engines_in(runs):
        for (w, _point), rs in runs[engine].items():
            if w == CAPACITY:
                verdicts.setdefault(engine, []).extend(
                    (PointVerdict(**{k: v for k, v in r["capacity"].items() if k in names}),
                     r["capacity"]) for r in rs if "capacity" in r)
    if not verdicts:
        return ""
    counts = sorted({v.sessions for vs in verdicts.values() for v, _ in vs})
    slos = sorted({(c["percentile"], c["slo_ttft_s"]) for vs in verdicts.values() for _, c in vs})
    slo = " or ".join(f"p{q:g} TTFT <= {t * 1000:.0f} ms" for q, t in slos)
    lines = [f"SLO: {slo}{' (differs between runs)' if len(slos) > 1 else ''} over every turn "
             "of a point, no failed request. Cells: TTFT at that percentile, ms (finished / sent); x: fails the SLO; "
             "-: not run (a smaller count failed).", "",
             f"| engine | max sessions at SLO | {' | '.join(str(n) for n in counts)} |",
             "|" + "---|" * (len(counts) + 2)]
    for engine, vs in verdicts.items():
        best, every = max_sessions_at_slo(v for v, _ in vs)
        cells = []
        for n in counts:
            here = [v for v, _ in vs if v.sessions == n]
            cells.append(" / ".join(f"{fmt(v.ttft_ms, 0)}{'' if v.passed else ' x'} "
                                    f"({v.requests - v.failed}/{v.requests})" for v in here) or "-")
        lines.append(f"| {engine} | {'>= ' if every else ''}{best} | {' | '.join(cells)} |")
    return "\n".join(lines)


def reuse_table(runs: dict, workload: str) -> str:
    """Per point: turns (after each session's first) whose computed prompt tokens were at
    most the new tokens plus one KV block, the worst excess and the totals."""
    lines = ["| engine | point | turns | computed <= new + block | block | worst excess (turn) | "
             "new tokens | computed tokens | reported - sent prompt tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for engine in engines_in(runs):
        for (w, point), rs in sorted(runs[engine].items(), key=lambda kv: _point_key(kv[0][1])):
            if w != workload:
                continue
            for r in rs:
                if "reuse" not in r:  # a run from before the per-turn accounting
                    continue
                u = r["reuse"]
                if u is None:
                    lines.append(f"| {engine} | {point} | cached tokens not reported |" + " |" * 6)
                    continue
                lines.append(
                    f"| {engine} | {point} | {u['turns']} | {u['within_bound']} | {u['block_size']} | "
                    f"{u['worst_excess']} ({u['worst_turn']}) | {u['new_tokens']} | "
                    f"{u['computed_tokens']} | {', '.join(str(o) for o in u['prompt_offsets'])} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for engine in engines_in(runs):
        pts = sorted((int(p[2:]), med(rs, "output_tok_per_s")) for (w, p), rs in runs[engine].items()
                     if w == "sweep")
        if pts:
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests (256 in, 128 out)")
    ax.set_ylabel("output tokens / s (median)")
    ax.set_title("SmolLM2-135M, 2 CPU threads, OpenAI streaming")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    runs, meta = load(args.paths)
    print("## Engines\n\n| engine | version | startup s | note |\n|---|---|---|---|")
    for e in engines_in(meta):
        m = meta[e]
        print(f"| {e} | {m.get('version', '-')} | {fmt(m.get('startup_s', math.nan), 0)} | "
              f"{m.get('skipped') or m.get('failed') or ''} |")
    workloads = sorted({w for r in runs.values() for (w, _) in r})
    for w in workloads:
        print(f"\n## {w}\n\n{table(runs, w)}\n")
        r = ratios(runs, w)
        if r:
            print(f"Output tok/s ratios:\n\n{r}\n")
        if w in PER_REQUEST and w != CAPACITY:  # capacity points: see the reuse table
            print(f"Prompt tokens, sent vs computed:\n\n{trace_table(runs, w)}\n")
        if w == CAPACITY:
            print(f"Concurrent sessions within the TTFT SLO:\n\n{capacity_table(runs)}\n")
        reuse = reuse_table(runs, w) if w in REPLAYS else ""
        if reuse:
            print(f"Prompt tokens computed per turn vs new tokens (`reuse.py`):\n\n{reuse}\n")
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
