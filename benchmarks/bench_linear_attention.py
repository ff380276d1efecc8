"""The CPU plugin's LINEAR backend against the core's reference, one Gated DeltaNet layer.

    python benchmarks/bench_linear_attention.py [--dtype bfloat16] [--repeats 5]

Qwen3-Next-80B's layer shape (16 key heads, 32 value heads, head dims 128, conv kernel
4: a 2 MiB float32 delta-rule state per sequence), states in arena pages of 32 KiB (the
full-attention page of that model at 16-token blocks). Steps: decode batches of 1, 8
and 32 sequences (one token each, continuing from their slots) and one prefill chunk of
256 tokens. Median milliseconds per layer call, both backends in one run (ratios are
what to compare on a shared machine), and the largest output difference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tokenmill.platforms.interfaces import (
    AttentionKind,
    AttentionSpec,
    RecurrentStateMetadata,
    recurrent_metadata,
)
from tokenmill.platforms.ops.linear_attention import (
    GatedDeltaInputs,
    ReferenceLinearAttentionBackend,
    gated_delta_state_spec,
)
from tokenmill_cpu.linear_attention import CpuLinearAttention

HK, HV, DK, DV, K = 16, 32, 128, 128, 4
PAGE = 32 * 1024


def _case(dtype: torch.dtype, query_lens: list[int], computed: int):
    conv = 2 * HK * DK + HV * DV
    state = gated_delta_state_spec(conv, K, HV, DK, DV, dtype)
    spec = AttentionSpec(AttentionKind.LINEAR, HV, HK, DK, dtype, 16, state=state)
    pages = -(-state.num_bytes // PAGE)
    num_seqs, t = len(query_lens), sum(query_lens)
    cache = torch.zeros(2, pages * num_seqs + 1, PAGE // 2, dtype=torch.uint8)
    slots = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(num_seqs)]
    g = torch.Generator().manual_seed(0)
    inputs = GatedDeltaInputs(
        mixed_qkv=torch.randn(t, conv, generator=g).to(dtype),
        g=-F.softplus(torch.randn(t, HV, generator=g)) * 0.5,
        beta=torch.rand(t, HV, generator=g).to(dtype),
        conv_weight=torch.randn(conv, K, generator=g).to(dtype),
        conv_bias=None, num_k_heads=HK, head_k_dim=DK, num_v_heads=HV, head_v_dim=DV,
    )
    rec = RecurrentStateMetadata(slots, slots if computed else [None] * num_seqs,
                                 [[] for _ in slots])
    seq_lens = [computed + q for q in query_lens]
    return spec, inputs, cache, recurrent_metadata(query_lens, seq_lens, rec, 16)


def _time(backend, spec, inputs, cache, meta, repeats: int) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = backend.forward(spec, inputs, cache, meta)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print("| step | reference ms | cpu plugin ms | speed-up | max abs diff |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for name, lens, computed in [("decode x1", [1], 100), ("decode x8", [1] * 8, 100),
                                     ("decode x32", [1] * 32, 100),
                                     ("prefill 256", [256], 0)]:
            spec, inputs, cache, meta = _case(dtype, lens, computed)
            ref_ms, ref = _time(ReferenceLinearAttentionBackend(), spec, inputs, cache.clone(),
                                meta, args.repeats)
            cpu_ms, got = _time(CpuLinearAttention(), spec, inputs, cache.clone(), meta,
                                args.repeats)
            diff = (got.float() - ref.float()).abs().max().item()
            print(f"| {name} | {ref_ms:.2f} | {cpu_ms:.2f} | {ref_ms / cpu_ms:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
