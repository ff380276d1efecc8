"""Load-test a running OpenAI-compatible server: `tokenmill bench serve --base-url URL`.

Sends `--num-prompts` streamed requests of `--input-len` words and `--output-len` tokens
(ignore_eos, greedy), at most `--max-concurrency` at a time, through loadgen.py, and
prints stats.py's summary: throughput, goodput under the SLO, TTFT / ITL / TPOT / E2E
percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as wl  # noqa: E402
from loadgen import Target, run_workload  # noqa: E402
from stats import Slo, summarize  # noqa: E402

# Plain words; with --tokenizer, words that are one token each (exact prompt lengths).
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name").split()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenmill bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (no /v1)")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="words per prompt")
    p.add_argument("--output-len", type=int, default=64, help="tokens per answer")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--tokenizer", default=None, help="the model's tokenizer.json")
    p.add_argument("--time-limit-s", type=float, default=600.0)
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.1)
    p.add_argument("--json", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    base = args.base_url.rstrip("/").removesuffix("/v1")
    model = args.model or httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    vocab = wl.one_token_words(Path(args.tokenizer)) if args.tokenizer else list(WORDS)
    sessions = wl.uniform(wl.Words(vocab), args.num_prompts, args.input_len, args.output_len)
    target = Target(base, model, {"ignore_eos": True})
    results, duration = asyncio.run(run_workload(target, sessions, args.max_concurrency,
                                                 args.time_limit_s))
    summary = summarize(results, duration, Slo(args.slo_ttft_s, args.slo_tpot_s))
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        shown = "n/a" if isinstance(value, float) and math.isnan(value) else (
            f"{value:.2f}" if isinstance(value, float) else value)
        print(f"{key:<{width}}  {shown}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    errors = sorted({r.error for r in results if r.error})
    for e in errors[:5]:
        print(f"error: {e}", file=sys.stderr)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
