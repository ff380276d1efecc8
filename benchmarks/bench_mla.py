"""Milliseconds per layer call: the core's reference MLA vs the CPU plugin's CpuMLAAttention.

Usage: python benchmarks/bench_mla.py [--iters 5] [--block-size 16] [--dtype bfloat16]

Shapes are DeepSeek-V3's per-head MLA dimensions (kv_lora_rank 512, rope 64, nope 128,
v 128) with 16 heads (a 128-head layer split over 8 tensor-parallel ranks). Cases: decode
of 1 and of 32 sequences (contexts 200-1000); a 256-token prefill chunk after 256 cached
tokens mixed with 15 decodes; a fresh 512-token prompt. Times are the minimum over
`--iters` runs (the machine may be shared); the backend's once-per-step `prepare` and
plan are rebuilt in every timed call (as the first layer of a step does).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec, MLADims
from tokenmill.platforms.ops.mla import mla_attention
from tokenmill_conformance.attention_harness import make_metadata, shuffled_tables
from tokenmill_cpu.mla import CpuMLAAttention

DIMS = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
HEADS = 16


def _cases() -> dict[str, list[tuple[int, int]]]:
    rng = random.Random(0)
    return {
        "decode 1 x 1000": [(999, 1)],
        "decode 32 x 200-1000": [(rng.randint(200, 1000), 1) for _ in range(32)],
        "chunk 256 after 256 + 15 decodes": [(256, 256)] + [(rng.randint(200, 1000), 1)
                                                           for _ in range(15)],
        "prefill 1 x 512": [(0, 512)],
    }


def _inputs(seqs, spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_tables(seqs, spec.block_size, random.Random(seed))
    meta = make_metadata(seqs, tables, spec.block_size)
    rank = DIMS.kv_lora_rank
    t = meta.num_tokens

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(spec.dtype)

    return dict(
        query=randn(t, HEADS, DIMS.qk_head_dim), key=randn(t, 1, DIMS.latent_size),
        kv_cache=randn(num_blocks, spec.block_size, DIMS.latent_size),
        w_uk=randn(HEADS, DIMS.qk_nope_head_dim, rank, std=rank**-0.5),
        w_uv=randn(HEADS, DIMS.v_head_dim, rank, std=rank**-0.5), metadata=meta,
    )


def _time(fn, iters: int) -> float:
    fn()
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    spec = AttentionSpec(AttentionKind.MLA, HEADS, 1, DIMS.latent_size, dtype, args.block_size,
                         scale=DIMS.qk_head_dim**-0.5, mla=DIMS)
    backend = CpuMLAAttention()
    print(f"MLA, {HEADS} heads, rank {DIMS.kv_lora_rank} + rope {DIMS.qk_rope_head_dim}, "
          f"{args.dtype}, blocks of {args.block_size}, {torch.get_num_threads()} threads\n")
    print("| case | tokens | reference ms | cpu_mla ms | speed-up |")
    print("|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name, seqs in _cases().items():
            x = _inputs(seqs, spec)
            args_ = (spec, x["query"], x["key"], None, x["kv_cache"], x["metadata"])
            weights = dict(w_uk=x["w_uk"], w_uv=x["w_uv"])
            ref = _time(lambda a=args_, w=weights: mla_attention(*a, **w), args.iters)

            def fast(a=args_, w=weights):
                backend.prepare(a[-1])
                return backend.forward(*a, **w)

            cpu = _time(fast, args.iters)
            print(f"| {name} | {x['metadata'].num_tokens} | {ref:.2f} | {cpu:.2f} | "
                  f"{ref / cpu:.1f}x |")


if __name__ == "__main__":
    main()
