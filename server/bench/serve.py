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

from tokenmill.server.bench import workloads as wl
from tokenmill.server.bench.editing import editing_tasks
from tokenmill.server.bench.loadgen import Session, Target, Turn, run_workload
from tokenmill.server.bench.stats import Slo, summarize

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
    p.add_argument("--workload", choices=["uniform", "editing"], default="uniform",
                   help="uniform: --input-len words per prompt; editing: agent-style edits "
                   "and tool calls over the standard library's sources (chat)")
    args = p.parse_args(argv)
    base = args.base_url.rstrip("/").removesuffix("/v1")
    try:
        served = httpx.get(f"{base}/v1/models", timeout=30)
    except httpx.TransportError as e:
        print(f"tokenmill bench serve: no server answers at {base} ({e}); start one with "
              "`tokenmill serve`, or pass --base-url", file=sys.stderr)
        return 2
    if served.status_code != 200:
        print(f"tokenmill bench serve: {base}/v1/models answered {served.status_code}: "
              f"{served.text[:200]}", file=sys.stderr)
        return 2
    model = args.model or served.json()["data"][0]["id"]
    if args.workload == "editing":
        sessions = [Session(f"edit{i}", [Turn(args.output_len, user=task)], chat=True)
                    for i, task in enumerate(editing_tasks(args.num_prompts))]
        target = Target(base, model, {"temperature": 0})
    else:
        vocab = wl.one_token_words(Path(args.tokenizer)) if args.tokenizer else list(WORDS)
        sessions = wl.uniform(wl.Words(vocab), args.num_prompts, args.input_len,
                              args.output_len)
        target = Target(base, model, {"ignore_eos": True})
    before = spec_counters(base)
    results, duration = asyncio.run(run_workload(target, sessions, args.max_concurrency,
                                                 args.time_limit_s))
    summary = summarize(results, duration, Slo(args.slo_ttft_s, args.slo_tpot_s))
    summary.update(spec_summary(before, spec_counters(base)))
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


_SPEC = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
         "spec_decode_num_accepted_tokens")


def spec_counters(base: str) -> dict[str, float] | None:
    """The server's speculative decoding counters (tokenmill's /metrics), summed over
    methods; None when it has none (speculation off, or another engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        reply = httpx.get(f"{base}/metrics", timeout=30)
    except httpx.TransportError:
        return None
    if reply.status_code != 200:
        return None
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(reply.text):
        name = family.name.removeprefix("tokenmill:")
        if name in _SPEC:
            found[name] = sum(s.value for s in family.samples if s.name.endswith("_total")
                              or s.name.endswith(name))
    return found or None


def spec_summary(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """The run's draft and accepted tokens and mean acceptance length (empty: none)."""
    if after is None:
        return {}
    before = before or {}
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _SPEC}
    drafts = delta["spec_decode_num_drafts"]
    return {
        "spec_draft_tokens": int(delta["spec_decode_num_draft_tokens"]),
        "spec_accepted_tokens": int(delta["spec_decode_num_accepted_tokens"]),
        "spec_mean_acceptance_length":
            1.0 + delta["spec_decode_num_accepted_tokens"] / drafts if drafts else float("nan"),
    }


if __name__ == "__main__":
    sys.exit(main())
