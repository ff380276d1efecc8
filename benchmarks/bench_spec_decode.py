"""Speculative decoding on the default model: an agent-style editing workload from the
standard library's sources (tokenmill.server.bench.editing), at several batch sizes,
each method against no speculation, in one run (docs/speculative.md).

    python benchmarks/bench_spec_decode.py --batches 1 16 64 --methods none ngram suffix

Batch b runs b tasks at once through `LLM.chat` (batch 1: `--batch1-tasks` tasks one
after another); every (batch, method) gets a fresh engine (the suffix method's global
tree starts empty) and its own tasks, the same tasks for every method. Greedy, so every
method must produce the same tokens: the script checks it. Reported: output tokens per
second end to end (prefill included), the ratio to no speculation, and the acceptance
counters. Figures are ratios measured in one run on a machine others share.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.server.bench.editing import editing_tasks

SPEC = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 5,
              "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 16},
}


def run_one(method: str, tasks: list[str], batch: int, max_tokens: int, args) -> dict:
    spec = SPEC.get(method)
    if spec is not None:
        spec = {**spec, "adaptive": not args.no_adaptive}
    llm = LLM(args.model, max_num_seqs=max(batch, 1), num_kv_blocks=args.num_kv_blocks,
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=8),
             use_tqdm=False)  # warm up (kernels compiled, first allocations)
    conversations = [[{"role": "user", "content": t}] for t in tasks]
    start = time.perf_counter()
    if batch == 1:
        outs = [o for c in conversations for o in llm.chat(c, params, use_tqdm=False)]
    else:
        outs = llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    row = {"method": method, "batch": batch, "seconds": seconds,
           "output_tokens": sum(map(len, tokens)),
           "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs), "tokens": tokens}
    row["tok_s"] = row["output_tokens"] / seconds
    if llm.engine.spec is not None:
        s = llm.engine.spec.drafter.stats
        row.update(num_drafts=s.num_drafts, draft_tokens=s.num_draft_tokens,
                   accepted_tokens=s.num_accepted_tokens,
                   mean_acceptance_length=s.mean_acceptance_length)
    llm.engine.shutdown()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--methods", nargs="+", default=["none", "ngram", "suffix"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch1-tasks", type=int, default=3)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--no-adaptive", action="store_true")
    p.add_argument("--json", default=None, help="write every row here")
    args = p.parse_args()
    rows = []
    offset = 0
    for batch in args.batches:
        n = args.batch1_tasks if batch == 1 else batch
        tasks = editing_tasks(n, seed=1000 + offset)
        offset += n
        base = None
        for method in args.methods:
            row = run_one(method, tasks, batch, args.max_tokens, args)
            if method == "none":
                base = row
            if base is not None and row is not base:
                row["speedup"] = row["tok_s"] / base["tok_s"]
                row["same_tokens"] = row["tokens"] == base["tokens"]
            rows.append(row)
            shown = {k: (round(v, 3) if isinstance(v, float) else v)
                     for k, v in row.items() if k != "tokens"}
            print(json.dumps(shown), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "tokens"} for r in rows], indent=1))


if __name__ == "__main__":
    main()
