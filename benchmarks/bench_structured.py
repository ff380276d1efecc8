"""Decode throughput with and without a json_schema constraint, and the mask's cost per step.

Default model, greedy, batch 1 and batch 16 (all submitted at once). Each constrained row
must produce a list of 12 records, which takes longer than `--output-len` tokens, so both
runs generate the same number of tokens (EOS ignored in the free run). The mask's cost is
timed inside the engine: filling the bitmask (llguidance, host) and applying it to the
logits (the platform's `apply_token_bitmask`, and the core's reference for comparison).

    python benchmarks/bench_structured.py [--dtype bfloat16] [--output-len 128] [--repeats 3]

Throughput is the best of `--repeats` runs, free and constrained interleaved; mask costs
are the median over every step of every run (on shared CPUs the best run is what the code
costs, the rest is neighbours). Prints a Markdown table (paste into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 12,
            "maxItems": 12,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "city": {"enum": ["Paris", "Berlin", "Rome", "Madrid", "Lisbon"]},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                },
                "required": ["name", "city", "age", "score"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}
PROMPT = "List twelve people as JSON records with name, city, age and a score between 0 and 1."


class Timer:
    """Wraps a callable and records the microseconds of each call."""

    def __init__(self, fn):
        self.fn, self.us = fn, []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.us.append((time.perf_counter() - start) * 1e6)


def run(llm, batch: int, output_len: int, constrained: bool):
    from tokenmill import SamplingParams, StructuredOutputsParams

    structured = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=not constrained,
                            structured_outputs=structured)
    conversation = [{"role": "user", "content": PROMPT}]
    start = time.perf_counter()
    outs = llm.chat([conversation] * batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / elapsed, tokens


def apply_cost_us(op, batch: int, vocab: int, dtype, iters: int = 30) -> float:
    """Best-of-`iters` microseconds for one call masking all `batch` rows."""
    logits = torch.randn(batch, vocab).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32)
    rows = torch.arange(batch)
    best = float("inf")
    for _ in range(iters):
        target = logits.clone()
        start = time.perf_counter()
        op(target, bitmask, rows)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,16")
    args = parser.parse_args()

    from tokenmill import LLM
    from tokenmill.platforms.ops.reference import apply_token_bitmask as reference_op

    llm = LLM(dtype=args.dtype)
    engine = llm.engine
    fill = Timer(engine.structured.step_masks)
    engine.structured.step_masks = fill
    apply = Timer(engine.executor.worker.runner.apply_token_bitmask)
    engine.executor.worker.runner.apply_token_bitmask = apply
    run(llm, 2, 8, True)  # warm-up: model, llguidance tokenizer, grammar cache
    vocab = engine.loaded.hf_config.vocab_size
    dtype = engine.dtype

    name = engine.platform.name
    print(f"| batch | free tok/s | json_schema tok/s | ratio | fill us/step | apply us/step "
          f"({name}) | apply us, best of 30: {name} / reference |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        free, constrained = [], []
        fill.us.clear()
        apply.us.clear()
        for _ in range(args.repeats):
            free.append(run(llm, batch, args.output_len, False)[0])
            rate, tokens = run(llm, batch, args.output_len, True)
            if tokens != batch * args.output_len:
                print(f"note: constrained run produced {tokens} tokens, not {batch * args.output_len}")
            constrained.append(rate)
        f, c = max(free), max(constrained)
        ref = apply_cost_us(reference_op, batch, vocab, dtype)
        own = apply_cost_us(engine.platform.ops.apply_token_bitmask, batch, vocab, dtype)
        print(f"| {batch} | {f:.1f} | {c:.1f} | {c / f:.2f} | {statistics.median(fill.us):.0f} | "
              f"{statistics.median(apply.us):.0f} | {own:.0f} / {ref:.0f} |")


if __name__ == "__main__":
    main()
