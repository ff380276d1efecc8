"""Milliseconds per layer call: the core's reference paged attention vs the CPU plugin's.

Usage: python benchmarks/bench_attention.py [--iters 10] [--block-size 16] [--threads N]
       [--dtypes bfloat16 float32] [--kv-cache-dtypes auto fp8 fp8_e5m2]

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head size 64). Cases: decode of
one sequence with a 1000- and a 4000-token context; decode of 64 sequences with contexts
drawn uniformly from 200-1000; a 512-token prefill chunk (after 512 cached tokens) mixed
with 63 such decodes; fresh prompts of 4 x 256 and 1 x 1024 tokens. "kernel" is the CPU
backend as the engine runs it: in bf16 the C++ paged attention for every row, in float32
the C++ decode kernel for decode rows and SDPA for prefill rows. The CPU backend's
`prepare` runs once per step and is shared by every layer, so it is reported separately
and not counted in the per-layer time. Times are the minimum over `--iters` runs (the
machine may be shared); every run reuses one cache, so small cases read it from L3.

`--kv-cache-dtypes fp8` (e4m3) / `fp8_e5m2` run the same cases over an FP8 cache with a
scale per KV head: "kernel" is the C++ FP8 decode kernel for decode rows (the gather and
SDPA for prefill rows), "sdpa" the dequantizing gather for every row (the FP8 path before
the kernel had one, and the fallback without the kernels).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from tokenmill.platforms.interfaces import AttentionKind, AttentionMetadata, AttentionSpec
from tokenmill.platforms.ops.kv_quant import KV_CACHE_DTYPES, quantize_kv
from tokenmill.platforms.ops.reference import paged_attention
from tokenmill_cpu.attention import CpuPagedAttention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 9, 3, 64


def make_step(
    seqs: list[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    cache_dtype: torch.dtype | None = None,
):
    """(query, key, value, kv_cache, metadata, scales) for sequences given as (cached, new)
    tokens; with an FP8 `cache_dtype` the cache holds the entries quantized by a distinct
    scale per KV head (`scales`: the k_scale / v_scale keywords, {} otherwise)."""
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
    scales = {}
    if cache_dtype is not None:
        heads = torch.arange(NUM_KV_HEADS, dtype=torch.float32)
        scales = {"k_scale": 0.01 + 0.002 * heads, "v_scale": 0.02 - 0.003 * heads}
        kv_cache = torch.stack([quantize_kv(kv_cache[i], s, cache_dtype)
                                for i, s in enumerate(scales.values())])
    return query, key, value, kv_cache, metadata, scales


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
    query, key, value, kv_cache, metadata, scales = step
    ref_ms = best_ms(
        lambda: paged_attention(spec, query, key, value, kv_cache, metadata, **scales), iters
    )
    times = []
    for use_kernels in (False, True):
        backend = CpuPagedAttention(spec.kind, use_kernels=use_kernels)
        prepare_ms = best_ms(lambda b=backend: b.prepare(metadata), iters)
        backend.prepare(metadata)
        times.append(
            best_ms(
                lambda b=backend: b.forward(spec, query, key, value, kv_cache, metadata, **scales),
                iters,
            )
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
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                        choices=["bfloat16", "float32"], help="compute dtypes")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"],
                        choices=["auto", *KV_CACHE_DTYPES], help="as --kv-cache-dtype")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, block size {args.block_size}"
    )
    header = (
        f"{'case':<40} {'dtype':<9} {'kv':<9} {'reference ms':>12} {'sdpa ms':>8} {'kernel ms':>9} "
        f"{'speedup':>8} {'prepare ms':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, seqs in cases(random.Random(0)).items():
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for kv in args.kv_cache_dtypes:
                cache_dtype = KV_CACHE_DTYPES.get(kv)
                spec = AttentionSpec(
                    AttentionKind.FULL, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, dtype,
                    args.block_size, cache_dtype=cache_dtype,
                )
                ref_ms, sdpa_ms, kernel_ms, prepare_ms = measure(
                    spec, make_step(seqs, args.block_size, dtype, cache_dtype=cache_dtype),
                    args.iters,
                )
                print(
                    f"{name:<40} {dtype_name:<9} {kv:<9} {ref_ms:>12.2f} {sdpa_ms:>8.3f} "
                    f"{kernel_ms:>9.3f} {ref_ms / kernel_ms:>7.1f}x {prepare_ms:>10.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
