"""Milliseconds per Mamba2 layer call: the core's reference linear-attention backend
(`ReferenceLinearAttentionBackend`, variant "mamba2") vs the CPU plugin's
(`CpuMamba2Attention`).

Usage: python benchmarks/bench_mamba2.py [--iters 10] [--threads N]

Mixer shapes are Bamba-9B's per layer (128 heads of 64, 1 group, state 128, conv 4,
chunks of 256; a state of 4 MiB float32 per sequence and layer), states in the arena's
pages (block size 16, pages of a 32-head x 128 bf16 attention layer) at shuffled block
ids, read and written through tokenmill.platforms.kit.kv_state as the engine does. Cases: decode of
1, 8 and 32 sequences; a 256-token prefill chunk continuing a sequence, with 7 decodes
beside it; a fresh 512-token prompt with checkpoints every 16 tokens. Both run the same
reads and writes of the pages; the reference runs each sequence's conv and state update
alone, the plugin batches the decodes (C++ kernel: one pass over the states). Times are
the minimum over `--iters` interleaved runs (the machine may be shared).
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections.abc import Callable

import torch

from tokenmill.platforms.interfaces import (
    AttentionKind,
    AttentionSpec,
    RecurrentStateMetadata,
    recurrent_metadata,
)
from tokenmill.platforms.kit.kv_state import pages_for, write_states, zero_states
from tokenmill.platforms.ops.linear_attention import ReferenceLinearAttentionBackend
from tokenmill.platforms.ops.mamba2 import (
    Mamba2Dims,
    Mamba2Inputs,
    Mamba2Weights,
    mamba2_state_spec,
)
from tokenmill_cpu import kernels
from tokenmill_cpu.mamba2 import CpuMamba2Attention

DIMS = Mamba2Dims(num_heads=128, head_dim=64, num_groups=1, state_size=128, conv_kernel=4,
                  chunk_size=256)
BLOCK = 16
PAGE_BYTES = 2 * BLOCK * 32 * 128 * 2


def make_step(seqs: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """(spec, inputs, state cache, metadata) for sequences given as (cached, new) tokens;
    cached > 0 reads the state from the slot, and prompts checkpoint every block."""
    rng = random.Random(seed)
    state = mamba2_state_spec(DIMS, dtype)
    spec = AttentionSpec(AttentionKind.LINEAR, DIMS.num_heads, DIMS.num_groups,
                         DIMS.state_size, dtype, BLOCK, state=state)
    per = pages_for(state, PAGE_BYTES)
    marks = [[b for b in range(1, new + 1) if (cached + b) % BLOCK == 0] for cached, new in seqs]
    num_blocks = per * (len(seqs) + sum(len(m) for m in marks)) + 1
    pool = list(range(1, num_blocks))
    rng.shuffle(pool)
    take = lambda: [pool.pop() for _ in range(per)]  # noqa: E731
    slots = [take() for _ in seqs]
    rec = RecurrentStateMetadata(
        state_block_ids=slots,
        source_block_ids=[s if cached else None for s, (cached, _) in zip(slots, seqs)],
        checkpoints=[[(b, take()) for b in m] for m in marks],
    )
    query_lens = [new for _, new in seqs]
    metadata = recurrent_metadata(query_lens, [c + n for c, n in seqs], rec, BLOCK)
    cache = torch.randint(0, 255, (2, num_blocks, PAGE_BYTES // 2), dtype=torch.uint8)
    # a sane state in every slot (random bytes are not finite floats)
    conv, ssm = zero_states(state, len(seqs), torch.device("cpu"))
    write_states(cache, state, slots, [conv.normal_(), ssm.normal_(0, 0.1)])
    tokens = sum(query_lens)
    g = torch.Generator().manual_seed(seed)
    weights = Mamba2Weights(
        conv_weight=torch.randn(DIMS.conv_dim, DIMS.conv_kernel, generator=g).to(dtype),
        conv_bias=torch.randn(DIMS.conv_dim, generator=g).to(dtype),
        dt_bias=torch.randn(DIMS.num_heads, generator=g).to(dtype),
        A=-torch.rand(DIMS.num_heads, generator=g) - 0.5,
        D=torch.randn(DIMS.num_heads, generator=g).to(dtype),
    )
    inputs = Mamba2Inputs(torch.randn(tokens, DIMS.conv_dim, generator=g).to(dtype),
                          torch.randn(tokens, DIMS.num_heads, generator=g).to(dtype), weights, DIMS)
    return spec, inputs, cache, metadata


def best_ms(fns: list[Callable[[], object]], iters: int) -> list[float]:
    """Interleaved runs, the minimum of each."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            fn()
            t.append(time.perf_counter() - start)
    return [min(t) * 1e3 for t in times]


CASES = {
    "decode x1": [(300, 1)],
    "decode x8": [(300 + 37 * i, 1) for i in range(8)],
    "decode x32": [(300 + 11 * i, 1) for i in range(32)],
    "prefill 256 (+256 cached) + 7 decodes": [(256, 256)] + [(300 + i, 1) for i in range(7)],
    "fresh 512, checkpoints every 16": [(0, 512)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"kernels {'built' if kernels.load() is not None else 'NOT built'}")
    reference, fast = ReferenceLinearAttentionBackend(), CpuMamba2Attention()
    print("| case | dtype | reference ms | cpu plugin ms | speedup |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for name, seqs in CASES.items():
            spec, inputs, cache, metadata = make_step(seqs, dtype)
            ref_cache, cpu_cache = cache.clone(), cache.clone()
            ref, cpu = best_ms([
                functools.partial(reference.forward, spec, inputs, ref_cache, metadata),
                functools.partial(fast.forward, spec, inputs, cpu_cache, metadata),
            ], args.iters)
            label = str(dtype).removeprefix("torch.")
            print(f"| {name} | {label} | {ref:.2f} | {cpu:.2f} | {ref / cpu:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
