"""Milliseconds per layer call: the core's reference paged attention vs the CPU plugin's.

Usage: python benchmarks/bench_attention.py [--iters 10] [--block-size 16] [--threads N]

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head size 64). Cases: decode of
one sequence with a 1000- and a 4000-token context; decode of 64 sequences with contexts
drawn uniformly from 200-1000; a 512-token prefill chunk (after 512 cached tokens) mixed
with 63 such decodes; fresh prompts of 4 x 256 and 1 x 1024 tokens. "kernel" is the CPU
backend as the engine runs it: in bf16 the C++ paged attention for every row, in float32
the C++ decode kernel for decode rows and SDPA for prefill rows. The CPU backend's
`prepare` runs once per step and is shared by every layer, so it is reported separately
and not counted in the per-layer time. Times are the minimum over `--iters` runs (the
machine may be shared); every run reuses one cache, so small cases read it from L3.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from tokenmill.platforms.interfaces import AttentionKind, AttentionMetadata, AttentionSpec
from tokenmill.platforms.ops.reference import paged_attention
from tokenmill_cpu.attention import CpuPagedAttention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 9, 3, 64


def make_step(seqs: list[tuple[int, int]], block_size: int, dtype: torch.dtype, seed: int = 0):
    """(query, key, value, kv_cache, metadata) for sequences given as (cached, new) tokens."""
    rng = random.Random(seed)
    needed = [-(-(cached + new) // block_size) for cached, new in seqs]
    num_blocks = sum(needed) + 1
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    block_ids = [[pool.pop() for _ in range(n)] for n in needed]
    query_lens = [new for _, new in seqs]
    metadata = AttentionMetadata.build(
        query_lens, [cached + new for cached, new in seqs], block_ids, block_size
    )
    num_tokens = metadata.num_tokens
    kv_cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE).to(dtype)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE).to(dtype)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE).to(dtype)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE).to(dtype)
    return query, key, value, kv_cache, metadata


def best_ms(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def measure(
    spec: AttentionSpec, step: tuple, iters: int
) -> tuple[float, float, float, float]:
    """(reference ms, cpu SDPA-only forward ms, cpu forward ms with the C++ decode kernel,
    cpu prepare ms) for one layer call on `step`."""
    query, key, value, kv_cache, metadata = step
    ref_ms = best_ms(lambda: paged_attention(spec, query, key, value, kv_cache, metadata), iters)
    times = []
    for use_kernels in (False, True):
        backend = CpuPagedAttention(spec.kind, use_kernels=use_kernels)
        prepare_ms = best_ms(lambda b=backend: b.prepare(metadata), iters)
        backend.prepare(metadata)
        times.append(
            best_ms(lambda b=backend: b.forward(spec, query, key, value, kv_cache, metadata), iters)
        )
    return ref_ms, times[0], times[1], prepare_ms


def cases(rng: random.Random) -> dict[str, list[tuple[int, int]]]:
    decodes = [(rng.randint(200, 1000) - 1, 1) for _ in range(64)]
    return {
        "decode b=1 ctx=256": [(255, 1)],
        "decode b=1 ctx=1000": [(999, 1)],
        "decode b=1 ctx=4000": [(3999, 1)],
        "decode b=64 ctx=200-1000": decodes,
        "prefill 512 (+512 cached) + 63 decodes": [(512, 512), *decodes[:63]],
        "prefill 4 x 256": [(0, 256)] * 4,
        "prefill 1024": [(0, 1024)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, block size {args.block_size}"
    )
    header = (
        f"{'case':<40} {'dtype':<9} {'reference ms':>12} {'sdpa ms':>8} {'kernel ms':>9} "
        f"{'speedup':>8} {'prepare ms':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, seqs in cases(random.Random(0)).items():
        for dtype in (torch.bfloat16, torch.float32):
            spec = AttentionSpec(
                AttentionKind.FULL, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, dtype, args.block_size
            )
            ref_ms, sdpa_ms, kernel_ms, prepare_ms = measure(
                spec, make_step(seqs, args.block_size, dtype), args.iters
            )
            dtype_name = str(dtype).removeprefix("torch.")
            print(
                f"{name:<40} {dtype_name:<9} {ref_ms:>12.2f} {sdpa_ms:>8.3f} {kernel_ms:>9.3f} "
                f"{ref_ms / kernel_ms:>7.1f}x {prepare_ms:>10.2f}"
            )


if __name__ == "__main__":
    main()
