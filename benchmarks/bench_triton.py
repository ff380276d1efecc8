"""The shared Triton kernels on a GPU, as the nvidia or rocm plugin launches them.

Usage: python benchmarks/bench_triton.py [--platform nvidia|rocm] [--markdown out.md]

Llama-3-8B shapes (32 query heads, 8 KV heads, head size 128, hidden 4096, intermediate
14336) in bf16, pages of 16 tokens. Each row: the kernel's time (triton.testing.do_bench:
median of CUDA-event timings after warm-up), the bytes it must move or the FLOPs it must
do, and the fraction of the plugin's declared HBM bandwidth or bf16 peak that makes
(`tokenmill_hardware_spec`). Attention decode counts the KV bytes read; prefill counts the
causal half of the QK^T and PV FLOPs; the element-wise kernels count bytes in and out;
fused MoE (8 experts, top-2, batch 64) counts the expert weights it streams.

With TRITON_INTERPRET=1 (no GPU) the kernels run in Triton's interpreter, which says
nothing about speed: the script then only checks each kernel once on tiny shapes against
the core's reference and prints the errors.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

import torch

from tokenmill.platforms.interfaces import AttentionKind, AttentionMetadata, AttentionSpec
from tokenmill.platforms.ops import reference
from tokenmill.platforms.registry import load_platform
from tokenmill_triton import elementwise, moe
from tokenmill_triton.attention import paged_attention
from tokenmill_triton.configs import KernelConfigs, interpreter_mode

HEADS, KV_HEADS, HEAD, HIDDEN, INTER, BLOCK = 32, 8, 128, 4096, 14336, 16


@dataclass(slots=True)
class Row:
    kernel: str
    shape: str
    ms: float
    work: float  # bytes or FLOPs
    unit: str  # "GB/s" or "TFLOP/s"
    peak: float  # the declared peak in the same unit's base (bytes/s or FLOP/s)

    def cells(self) -> list[str]:
        rate = self.work / (self.ms * 1e-3)
        scale = 1e9 if self.unit == "GB/s" else 1e12
        return [self.kernel, self.shape, f"{self.ms:.3f}", f"{rate / scale:.1f} {self.unit}",
                f"{rate / self.peak:.0%}"]


def metadata_for(seqs: list[tuple[int, int]], device: torch.device) -> AttentionMetadata:
    """Sequences of (cached, new) tokens with shuffled pages."""
    needed = [-(-(c + n) // BLOCK) for c, n in seqs]
    pool = list(range(sum(needed)))
    random.Random(0).shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in needed]
    return AttentionMetadata.build([n for _, n in seqs], [c + n for c, n in seqs], tables,
                                   BLOCK, device)


def attention_rows(configs: KernelConfigs, bandwidth: float, peak: float,
                   device: torch.device) -> list[Row]:
    from triton.testing import do_bench

    rows = []
    cases = [("decode", [(4095, 1)]), ("decode", [(32767, 1)]), ("decode", [(1023, 1)] * 64),
             ("prefill", [(0, 4096)]), ("mixed", [(512, 512)] + [(1023, 1)] * 63)]
    for phase, seqs in cases:
        meta = metadata_for(seqs, device)
        num_blocks = int(meta.block_tables.max()) + 1
        cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD, device=device,
                            dtype=torch.bfloat16)
        q = torch.randn(meta.num_tokens, HEADS, HEAD, device=device, dtype=torch.bfloat16)
        ms = do_bench(lambda q=q, cache=cache, meta=meta: paged_attention(
            q, cache, meta, HEAD**-0.5, configs))
        kv_bytes = sum(meta.seq_lens_cpu) * 2 * KV_HEADS * HEAD * 2
        shape = f"{len(seqs)} x (ctx {seqs[0][0]}, new {seqs[0][1]})"
        if phase == "prefill":
            flops = sum(4 * HEADS * HEAD * n * (n + 1) / 2 for _, n in seqs)
            rows.append(Row("attention prefill", shape, ms, flops, "TFLOP/s", peak))
        else:
            rows.append(Row(f"attention {phase}", shape, ms, kv_bytes, "GB/s", bandwidth))
    return rows


def elementwise_rows(configs: KernelConfigs, bandwidth: float, device: torch.device) -> list[Row]:
    from triton.testing import do_bench

    cfg = configs.elementwise
    rows = []
    for tokens in (64, 4096):
        x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
        r, w = torch.randn_like(x), torch.randn(HIDDEN, device=device, dtype=torch.bfloat16)
        ms = do_bench(lambda x=x, r=r, w=w: elementwise.fused_add_rms_norm(x, r, w, 1e-5, cfg))
        rows.append(Row("fused_add_rms_norm", f"{tokens} x {HIDDEN}", ms, 4 * x.nbytes,
                        "GB/s", bandwidth))
        gate_up = torch.randn(tokens, 2 * INTER, device=device, dtype=torch.bfloat16)
        ms = do_bench(lambda g=gate_up: elementwise.silu_and_mul(g, cfg))
        rows.append(Row("silu_and_mul", f"{tokens} x 2*{INTER}", ms, 1.5 * gate_up.nbytes,
                        "GB/s", bandwidth))
        q = torch.randn(tokens, HEADS, HEAD, device=device, dtype=torch.bfloat16)
        k = torch.randn(tokens, KV_HEADS, HEAD, device=device, dtype=torch.bfloat16)
        pos = torch.arange(tokens, device=device)
        cache = torch.randn(8192, HEAD, device=device)
        ms = do_bench(lambda q=q, k=k, pos=pos, c=cache: elementwise.rotary_embedding(
            pos, q, k, c, cfg))
        rows.append(Row("rotary", f"{tokens} tokens", ms, 2 * (q.nbytes + k.nbytes), "GB/s",
                        bandwidth))
    return rows


def moe_rows(configs: KernelConfigs, bandwidth: float, device: torch.device) -> list[Row]:
    from triton.testing import do_bench

    experts, top_k, tokens = 8, 2, 64
    x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(experts, 2 * INTER, HIDDEN, device=device, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, HIDDEN, INTER, device=device, dtype=torch.bfloat16) * 0.02
    logits = torch.randn(tokens, experts, device=device)
    ms = do_bench(lambda: moe.fused_moe(x, w1, w2, logits, top_k, configs))
    # at batch 64 with 8 experts every expert is hit: all weights stream once
    return [Row("fused_moe", f"{tokens} tok, {experts} experts, top{top_k}", ms,
                w1.nbytes + w2.nbytes, "GB/s", bandwidth)]


def check_in_interpreter(configs: KernelConfigs) -> list[list[str]]:
    """Each kernel once on tiny shapes against the reference: [kernel, max abs error]."""
    g = torch.Generator().manual_seed(0)
    spec = AttentionSpec(AttentionKind.FULL, 4, 2, 64, torch.float32, BLOCK)
    meta = metadata_for([(40, 1), (0, 9)], torch.device("cpu"))
    cache = torch.randn(2, int(meta.block_tables.max()) + 1, BLOCK, 2, 64, generator=g)
    q = torch.randn(meta.num_tokens, 4, 64, generator=g)
    kv = torch.randn(meta.num_tokens, 2, 64, generator=g)
    expected = reference.paged_attention(spec, q, kv, kv, cache.clone(), meta)
    reference.write_kv(kv, kv, cache, meta.slot_mapping)
    results = [("paged_attention", paged_attention(q, cache, meta, 64**-0.5, configs), expected)]
    x, w = torch.randn(5, 96, generator=g), torch.randn(96, generator=g)
    cfg = configs.elementwise
    results.append(("rms_norm", elementwise.rms_norm(x, w, 1e-6, cfg),
                    reference.rms_norm(x, w, 1e-6)))
    gu = torch.randn(5, 64, generator=g)
    results.append(("silu_and_mul", elementwise.silu_and_mul(gu, cfg),
                    reference.silu_and_mul(gu)))
    return [[name, f"{(got - want).abs().max().item():.2e}"] for name, got, want in results]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", default="nvidia", choices=["nvidia", "rocm"])
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args(argv)
    active = load_platform(args.platform)
    spec = AttentionSpec(AttentionKind.FULL, HEADS, KV_HEADS, HEAD, torch.bfloat16, BLOCK)
    configs: KernelConfigs = active.attention_backend(spec).configs
    if interpreter_mode():
        print("Triton interpreter mode: kernels run in Python on the CPU, so this only checks "
              "correctness (no timings).")
        text = table(["kernel", "max abs error vs reference"], check_in_interpreter(configs))
    else:
        hw = active.hardware_spec()
        device = active.platform.device
        peak = hw.peak_flops["bfloat16"]
        rows: list[Row] = []
        for make in (lambda: attention_rows(configs, hw.memory_bandwidth, peak, device),
                     lambda: elementwise_rows(configs, hw.memory_bandwidth, device),
                     lambda: moe_rows(configs, hw.memory_bandwidth, device)):
            rows += make()
        title = f"{hw.name}: {hw.memory_bandwidth / 1e12:.2f} TB/s, bf16 {peak / 1e12:.0f} TFLOP/s"
        text = f"{title}\n\n" + table(["kernel", "shape", "ms", "achieved", "of peak"],
                                      [r.cells() for r in rows])
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
