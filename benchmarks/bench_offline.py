"""Offline throughput on the default model: tokenmill vs HF transformers, in one run.

Workloads (both engines, same prompts, same dtype, same threads, EOS ignored):
  batch:  64 prompts x 128 output tokens, all submitted at once
  single: batch-1 decode, one prompt x 128 output tokens

    python benchmarks/bench_offline.py [--dtype bfloat16] [--num-prompts 64] [--output-len 128]

Prints a Markdown table (paste into docs/benchmarks.md) and writes JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

SEEDS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works to a new programmer.",
    "List five facts about the planet Mars.",
    "What are the main causes of inflation in an economy?",
    "Describe the water cycle in simple terms.",
    "Give me a recipe for a quick vegetarian dinner.",
    "Summarize the plot of a mystery novel set in Venice.",
    "Why is the sky blue? Answer like a physics teacher.",
]


def make_prompts(n: int) -> list[str]:
    return [f"{SEEDS[i % len(SEEDS)]} (variant {i})" for i in range(n)]


def bench_tokenmill(prompts, output_len, dtype, repeats):
    from tokenmill import LLM, SamplingParams

    llm = LLM(dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    batch, single = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        batch.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        t = time.perf_counter()
        out = llm.generate(prompts[:1], params, use_tqdm=False)[0]
        single.append(len(out.outputs[0].token_ids) / (time.perf_counter() - t))
    return batch, single, llm.get_tokenizer()


def bench_transformers(prompts, output_len, dtype, repeats, tokenizer):
    from transformers import AutoModelForCausalLM

    from tokenmill.model.loader import default_model_path

    path = Path(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    model = model.to(getattr(torch, dtype)).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = dict(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )

    def run(batch_prompts):
        enc = tokenizer(batch_prompts, return_tensors="pt", padding=True)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, **kwargs)
        elapsed = time.perf_counter() - t
        return (out.shape[1] - enc["input_ids"].shape[1]) * len(batch_prompts) / elapsed

    run(prompts[:2])  # warm-up
    batch, single = [], []
    for _ in range(repeats):
        batch.append(run(prompts))
        single.append(run(prompts[:1]))
    return batch, single


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    prompts = make_prompts(args.num_prompts)
    tm_batch, tm_single, tok = bench_tokenmill(prompts, args.output_len, args.dtype, args.repeats)
    rows = {"tokenmill": (tm_batch, tm_single)}
    if not args.skip_transformers:
        rows["transformers"] = bench_transformers(
            prompts, args.output_len, args.dtype, args.repeats, tok
        )

    med = {k: (statistics.median(b), statistics.median(s)) for k, (b, s) in rows.items()}
    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, dtype {args.dtype}, median of {args.repeats}\n"
    )
    print(f"| engine | {args.num_prompts} x {args.output_len} output tok/s | batch-1 decode tok/s |")
    print("|---|---|---|")
    for name, (b, s) in med.items():
        print(f"| {name} | {b:.0f} | {s:.1f} |")
    if "transformers" in med:
        (tb, ts), (hb, hs) = med["tokenmill"], med["transformers"]
        print(f"| ratio tokenmill / transformers | {tb / hb:.2f}x | {ts / hs:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
