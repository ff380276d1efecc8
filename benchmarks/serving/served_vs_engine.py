"""What serving costs: `tokenmill serve` (API process + engine process) against the engine
core alone, measured alternately in one run so a busy machine weighs on both sides alike.

    python benchmarks/serving/served_vs_engine.py [--model PATH] [--rounds 3] \
        [--num 64] [--input-len 256] [--output-len 128] [--single-output-len 128]

- throughput: `--num` requests of `--input-len` prompt words (one token each) and
  `--output-len` output tokens (EOS ignored), all in flight at once. Served: streamed
  completions through loadgen.py at concurrency `--num`, output tokens / wall time at the
  client. Engine-only: the same token ids added to an in-process `LLMEngine` and stepped with
  `core_step()` (scheduler, model, sampler, token bookkeeping; no detokenization, no HTTP)
  until done.
- batch-1 inter-token latency: one request of `--single-output-len` tokens. Served: the
  client's median gap between streamed chunks. Engine-only: the median `core_step()` time
  of its decode steps.

Both sides use the same model, dtype, threads (OMP_NUM_THREADS, default 2) and engine
arguments. Prints a Markdown table: medians of each side, and the served / engine ratio of
each round (the two sides of a round run back to back, alternating which goes first) with
their median; --json saves the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import engines

from tokenmill.server.bench import workloads as wl
from tokenmill.server.bench.loadgen import Target, run_client, run_workload
from tokenmill.server.bench.stats import percentile


def _model_path(arg: str | None) -> str:
    from tokenmill.model.loader import default_model_path

    return arg or default_model_path()


def _words(engine) -> wl.Words:
    """Words that are one token each with a leading space, from the engine's vocabulary."""
    vocab = engine.tokenizer.get_vocab()
    words = sorted(w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and
                   w[1:].islower() and 3 <= len(w) - 1 <= 9)
    return wl.Words(words[:4000])


def engine_batch(engine, prompts: list[list[int]], output_len: int) -> float:
    """Output tok/s of the engine core alone on a batch that starts all at once."""
    from tokenmill import SamplingParams
    from tokenmill.frontend.outputs import EngineCoreRequest

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_core_request(EngineCoreRequest(f"b{time.monotonic_ns()}-{i}", ids, params))
    num = 0
    while engine.has_unfinished_requests():
        num += sum(len(d.new_token_ids) for d in engine.core_step())
    return num / (time.perf_counter() - t0)


def engine_single_itl_ms(engine, prompt: list[int], output_len: int) -> float:
    """Median core_step time (ms) of one request's decode steps."""
    from tokenmill import SamplingParams
    from tokenmill.frontend.outputs import EngineCoreRequest

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_core_request(EngineCoreRequest(f"s{time.monotonic_ns()}", prompt, params))
    steps, first = [], True
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        deltas = engine.core_step()
        if deltas and deltas[0].new_token_ids:
            if not first:  # the first token ends the prefill
                steps.append(time.perf_counter() - t)
            first = False
    return statistics.median(steps) * 1000


def served_batch(target: Target, sessions) -> float:
    results, duration = run_client(run_workload(target, sessions, len(sessions), 600, 900))
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} served requests failed: {bad[:3]}")
    return sum(r.output_tokens for r in results) / duration


def served_single_itl_ms(target: Target, sessions) -> float:
    results, _ = run_client(run_workload(target, sessions, 1, 600, 900))
    (res,) = results
    if not res.ok:
        raise RuntimeError(f"the served request failed: {res.error}")
    return percentile(res.itls, 50) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--single-output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)

    import torch

    from tokenmill.engine.config import EngineArgs
    from tokenmill.engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    model = _model_path(args.model)
    engine = LLMEngine(EngineArgs(model=model, max_model_len=args.max_model_len))
    words = _words(engine)
    sessions = wl.uniform(words, args.num, args.input_len, args.output_len, tag="sv")
    single = wl.uniform(words, 1, args.input_len, args.single_output_len, tag="one")
    tok = engine.tokenizer
    batch_ids = [tok.encode(s.turns[0].prompt) for s in sessions]  # what /v1/completions sends
    single_ids = tok.encode(single[0].turns[0].prompt)

    spec = engines.EngineSpec(
        "tokenmill",
        [sys.executable, "-m", "tokenmill.server.cli", "serve", model, "--port", str(args.port),
         "--served-model-name", engines.SERVED, "--max-model-len", str(args.max_model_len),
         "--log-level", "warning"],
        env={"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)},
        extra_body={"ignore_eos": True},
    )
    target = Target(f"http://127.0.0.1:{args.port}", engines.SERVED, spec.extra_body)
    runs: dict[str, list[float]] = {k: [] for k in ("engine_tps", "served_tps", "engine_itl", "served_itl")}
    log = Path(tempfile.gettempdir()) / "served_vs_engine.log"
    with engines.EngineProcess(spec, args.port, log):
        # warm-up: both sides once, small
        engine_batch(engine, batch_ids[:4], 8)
        run_client(run_workload(target, wl.uniform(words, 4, 64, 8, tag="warm"), 4, 120, 300))
        for r in range(args.rounds):
            # alternate which side goes first, so a drift in the machine's load cancels
            order = ("engine", "served") if r % 2 == 0 else ("served", "engine")
            for side in order:
                if side == "engine":
                    runs["engine_tps"].append(engine_batch(engine, batch_ids, args.output_len))
                    runs["engine_itl"].append(engine_single_itl_ms(engine, single_ids, args.single_output_len))
                else:
                    runs["served_tps"].append(served_batch(target, sessions))
                    runs["served_itl"].append(served_single_itl_ms(target, single))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()),
                  flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    # paired: each round's served / engine, both sides measured minutes apart
    tps_ratios = [s / e for s, e in zip(runs["served_tps"], runs["engine_tps"])]
    itl_ratios = [s / e for s, e in zip(runs["served_itl"], runs["engine_itl"])]
    print(f"\nmachine: {platform.processor() or platform.machine()}, {args.threads} threads, "
          f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}, "
          f"median of {args.rounds} alternated rounds\n")
    print("| measure | engine only | served | served / engine, per round | median |")
    print("|---|---|---|---|---|")
    print(f"| {args.num} x ({args.input_len} in, {args.output_len} out) output tok/s | "
          f"{med['engine_tps']:.1f} | {med['served_tps']:.1f} | "
          f"{' '.join(f'{r:.3f}' for r in tps_ratios)} | {statistics.median(tps_ratios):.3f} |")
    print(f"| batch-1 inter-token latency, ms | {med['engine_itl']:.2f} | {med['served_itl']:.2f} | "
          f"{' '.join(f'{r:.3f}' for r in itl_ratios)} | {statistics.median(itl_ratios):.3f} |")
    print("\nper round: " + json.dumps({k: [round(x, 2) for x in v] for k, v in runs.items()}))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
