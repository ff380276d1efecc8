"""Milliseconds per Sampler call on CPU for common sampling setups.

Usage: python benchmarks/bench_sampler.py [--vocab 49152] [--iters 20] [--threads N]

Logits are random normal times `--scale` (4 by default gives an LLM-like peaked
distribution whose top-p nucleus fits in a few hundred tokens; 1 gives a nearly flat one
that forces the full-sort fallback). Rows carry a 512-token prompt and 128 outputs.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.platforms.kit.sampler import Sampler, SamplingRow, make_generator
from tokenmill.sampling_params import SamplingParams

CASES: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "temp+top_p+top_k": dict(temperature=0.8, top_p=0.9, top_k=50),
    "temp+top_p": dict(temperature=0.8, top_p=0.9),
    "temp+min_p": dict(temperature=0.8, min_p=0.05),
    "penalties (greedy)": dict(
        temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5
    ),
    "penalties+temp+top_p+top_k": dict(
        temperature=0.8, top_p=0.9, top_k=50,
        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
    ),
    "greedy+logprobs=5": dict(temperature=0.0, logprobs=5),
    # OpenAI's logit_bias: 300 biased tokens per row (a typical "ban a word list" request)
    "greedy+logit_bias (300 tokens)": dict(
        temperature=0.0, logit_bias={t: -100.0 if t % 2 else 5.0 for t in range(0, 3000, 10)}
    ),
}


def time_call(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], iters: int) -> float:
    """Best-of-`iters` milliseconds per call: on shared CPUs the minimum is what the code
    costs, the rest is neighbours."""
    sampler(logits, rows)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        sampler(logits, rows)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--scale", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    sampler = Sampler()
    prompt = torch.randint(0, args.vocab, (512,)).tolist()
    output = torch.randint(0, args.vocab, (128,)).tolist()
    batch_sizes = (1, 64)
    print(f"vocab={args.vocab} scale={args.scale} threads={torch.get_num_threads()}, "
          f"best of {args.iters}, ms per call")
    print(f"{'case':<30}" + "".join(f"{f'rows={n}':>14}" for n in batch_sizes)
          + f"{'rows=64 seeded':>16}")
    for name, kwargs in CASES.items():
        cells = []
        for num_rows, seeded in [(n, False) for n in batch_sizes] + [(64, True)]:
            logits = torch.randn(num_rows, args.vocab) * args.scale
            rows = [
                SamplingRow(
                    params=SamplingParams(**kwargs, seed=i if seeded else None).with_defaults(),
                    prompt_token_ids=prompt,
                    output_token_ids=output,
                    generator=make_generator(i, "cpu") if seeded else None,
                )
                for i in range(num_rows)
            ]
            cells.append(time_call(sampler, logits, rows, args.iters))
        print(f"{name:<30}" + "".join(f"{c:>14.2f}" for c in cells[:-1]) + f"{cells[-1]:>16.2f}")


if __name__ == "__main__":
    main()
