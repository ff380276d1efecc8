"""The Triton LINEAR backend (gated_delta, kda, mamba2) as the nvidia or rocm plugin runs it,
against the core's reference backend, one layer call per step.

Usage: python benchmarks/bench_triton_linear.py [--platform nvidia|rocm] [--markdown out.md]

On a GPU: bf16 layers of the real models' shapes (Qwen3-Next's Gated DeltaNet: 16 key and
32 value heads of 128; Kimi Linear's KDA: 32 heads of 128; Bamba-9B's Mamba2: 128 heads of
64, one B/C group, state 128; conv width 4), states in arena pages of 64 KiB. Steps: decode
batches of 1 and 64 sequences continuing from their slots, and one 4096-token prefill.
Each row: the backend's time (triton.testing.do_bench, median of CUDA-event timings after
warm-up, the state gather and scatter included), the reference's time (one run: it loops
over sequences in Python), and for decode the fraction of the declared HBM bandwidth that
reading and writing the float32 states makes (the bytes that bound a decode step).

With TRITON_INTERPRET=1 (no GPU) the kernels run in Triton's interpreter, one Python call
per tensor op of every program: the script then runs tiny shapes once each, prints both
times and the largest output difference, and those times say nothing about a GPU (the
point of the mode is that the script and the kernels run; see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

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
    KDAInputs,
    ReferenceLinearAttentionBackend,
    gated_delta_state_spec,
    kda_state_spec,
)
from tokenmill.platforms.ops.mamba2 import (
    Mamba2Dims,
    Mamba2Inputs,
    Mamba2Weights,
    mamba2_state_spec,
)
from tokenmill.platforms.registry import load_platform
from tokenmill_triton.configs import interpreter_mode

PAGE = 64 * 1024
# variant -> layer shape (GPU, interpreter)
SHAPES = {
    "gated_delta": (dict(hk=16, hv=32, dk=128, dv=128), dict(hk=1, hv=2, dk=16, dv=16)),
    "kda": (dict(h=32, d=128), dict(h=2, d=16)),
    "mamba2": (dict(h=128, p=64, g=1, n=128), dict(h=4, p=16, g=2, n=16)),
}
CONV_K = 4


def _layer(variant: str, shape: dict, t: int, dtype, device, gen):
    """(spec, inputs) of one layer for a step of t tokens."""
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    decay = lambda *s: -F.softplus(rnd(*s)) * 0.5  # noqa: E731
    if variant == "gated_delta":
        hk, hv, dk, dv = shape["hk"], shape["hv"], shape["dk"], shape["dv"]
        conv = 2 * hk * dk + hv * dv
        state = gated_delta_state_spec(conv, CONV_K, hv, dk, dv, dtype)
        inputs = GatedDeltaInputs(rnd(t, conv).to(dtype), decay(t, hv),
                                  torch.rand(t, hv, generator=gen).to(device, dtype),
                                  rnd(conv, CONV_K).to(dtype) * 0.5, None, hk, dk, hv, dv)
        return AttentionSpec(AttentionKind.LINEAR, hv, hk, dk, dtype, 16, state=state), inputs
    if variant == "kda":
        h, d = shape["h"], shape["d"]
        state = kda_state_spec(h, d, CONV_K, dtype)
        inputs = KDAInputs(rnd(t, 3 * h * d).to(dtype), decay(t, h, d),
                           torch.rand(t, h, generator=gen).to(device, dtype),
                           rnd(3 * h * d, CONV_K).to(dtype) * 0.5, h, d)
        return AttentionSpec(AttentionKind.LINEAR, h, h, d, dtype, 16, state=state), inputs
    dims = Mamba2Dims(num_heads=shape["h"], head_dim=shape["p"], num_groups=shape["g"],
                      state_size=shape["n"], conv_kernel=CONV_K, chunk_size=256)
    weights = Mamba2Weights(rnd(dims.conv_dim, CONV_K).to(dtype) * 0.5,
                            rnd(dims.conv_dim).to(dtype), rnd(dims.num_heads).to(dtype),
                            -torch.rand(dims.num_heads, generator=gen).to(device) - 0.2,
                            rnd(dims.num_heads).to(dtype))
    inputs = Mamba2Inputs(rnd(t, dims.conv_dim).to(dtype), rnd(t, dims.num_heads).to(dtype),
                          weights, dims)
    spec = AttentionSpec(AttentionKind.LINEAR, dims.num_heads, dims.num_groups,
                         dims.state_size, dtype, 16, state=mamba2_state_spec(dims, dtype))
    return spec, inputs


def _step(spec, query_lens: list[int], computed: int, device):
    """A state cache with one slot per sequence and the step's metadata."""
    pages = -(-spec.state.num_bytes // PAGE)
    slots = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(len(query_lens))]
    cache = torch.zeros(2, pages * len(query_lens) + 1, PAGE // 2, dtype=torch.uint8,
                        device=device)
    rec = RecurrentStateMetadata(slots, slots if computed else [None] * len(slots),
                                 [[] for _ in slots])
    meta = recurrent_metadata(query_lens, [computed + q for q in query_lens], rec, 16, device)
    return cache, meta


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(active, interpreted: bool) -> list[list[str]]:
    backend = next(b for b in active.attention_backends if b.kind == AttentionKind.LINEAR)
    reference = ReferenceLinearAttentionBackend()
    device = active.platform.device
    dtype = torch.float32 if interpreted else torch.bfloat16
    steps = ([("decode x1", [1], 40), ("decode x4", [1] * 4, 40), ("prefill 37", [37], 0)]
             if interpreted else
             [("decode x1", [1], 1000), ("decode x64", [1] * 64, 1000),
              ("prefill 4096", [4096], 0)])
    bandwidth = None if interpreted else active.hardware_spec().memory_bandwidth
    rows = []
    for variant in sorted(backend.variants):
        shape = SHAPES[variant][1 if interpreted else 0]
        for name, lens, computed in steps:
            spec, inputs = _layer(variant, shape, sum(lens), dtype, device,
                                  torch.Generator().manual_seed(0))
            cache, meta = _step(spec, lens, computed, device)
            ref_cache = cache.clone()
            out = backend.forward(spec, inputs, cache.clone(), meta)
            want = reference.forward(spec, inputs, ref_cache.clone(), meta)
            diff = (out.float() - want.float()).abs().max().item()
            ref_ms = _seconds(partial(reference.forward, spec, inputs, ref_cache, meta)) * 1e3
            fast = partial(backend.forward, spec, inputs, cache, meta)
            if interpreted:
                ms = _seconds(fast) * 1e3
                roofline = "-"
            else:
                from triton.testing import do_bench

                ms = do_bench(fast)
                ssm_bytes = spec.state.tensors[1].num_bytes if name.startswith("decode") else 0
                moved = 2 * ssm_bytes * len(lens)
                roofline = f"{moved / (ms * 1e-3) / bandwidth:.0%}" if moved else "-"
            rows.append([variant, name, f"{ms:.3f}", f"{ref_ms:.3f}", f"{ref_ms / ms:.1f}x",
                         roofline, f"{diff:.1e}"])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", default="nvidia", choices=["nvidia", "rocm"])
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args(argv)
    active = load_platform(args.platform)
    interpreted = interpreter_mode()
    if interpreted:
        print("Triton interpreter mode: kernels run in Python on the CPU; the times below "
              "say nothing about a GPU (tiny float32 shapes, one run each).")
    header = ["variant", "step", "triton ms", "reference ms", "speed-up",
              "of HBM bandwidth (decode states)", "max abs diff"]
    text = table(header, run(active, interpreted))
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
