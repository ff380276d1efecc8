"""The kernels the performance model predicts, run on the active platform and timed: GEMMs
of several widths, every attention kind the engine would run (the platform's backend, or
the core's reference where the engine falls back to it), MoE experts, a norm.

Each measurement is (op class, the model's `OpCost` of it, seconds): calibration divides
the roofline time at full efficiency by the time taken to get the efficiency. Shapes are
chosen so each op class has a compute-bound point (prefill-like) and a memory-bound one
(decode-like), and a tiny one (`latency`: one token, one short sequence) whose time is
the call's fixed cost, which a small model's decode step is made of.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.planner import ops
from tokenmill.planner.ops import OpCost, Seq
from tokenmill.platforms.interfaces import (
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
    MLADims,
    RecurrentStateMetadata,
    recurrent_metadata,
)

BLOCK = 16


@dataclass(frozen=True, slots=True)
class Measured:
    name: str
    cost: OpCost
    seconds: float
    latency: bool = False  # a tiny call: its time is the op class's fixed cost a call


def point_dict(p: Measured) -> dict:
    """A measurement as calibration stores it (the JSON of `measured.points`)."""
    return {"name": p.name, "op": p.cost.op, "flops": p.cost.flops, "bytes": p.cost.bytes,
            "inner": p.cost.inner, "outer": p.cost.outer, "seconds": p.seconds,
            "latency": p.latency}


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median of `repeats` timed calls after a warm-up: the speed an engine's steps
    see. (The fastest call was taken before; on this 2-core VM a decode step's median is
    19-24% above its fastest on a quiet machine, and predictions from the fastest fell
    short by that on every step: docs/planner.md, run 7.)"""
    def sync() -> None:
        if device.type != "cpu":
            torch.accelerator.synchronize()

    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_points(active, dtype: torch.dtype, device: torch.device, quick: bool) -> list[Measured]:
    """[rows, k] x [k, n] through the platform's prepacked linear (as the engine's layers
    run it), or torch's linear."""
    # compute-bound widths, then weight streams larger than any cache (128 MiB of bf16:
    # a CPU's L3, a GPU's L2 hold less), as a decode step reads a model's weights
    shapes = [(512, 2048, 2048), (512, 256, 2048), (512, 2048, 256), (512, 1024, 1024),
              (1, 8192, 8192), (4, 8192, 8192), (1, 64, 64)]
    if quick:
        shapes = [(256, 1024, 1024), (256, 128, 1024), (1, 8192, 8192), (1, 64, 64)]
    out = []
    b = dtype.itemsize
    for rows, k, n in shapes:
        weight = (torch.randn(n, k) / k**0.5).to(dtype).to(device)
        x = torch.randn(rows, k).to(dtype).to(device)
        prepack = getattr(active.ops, "prepack_linear", None)
        apply = prepack(weight, None) if prepack is not None else None
        fn = (lambda x=x, apply=apply: apply(x)) if apply else (
            lambda x=x, w=weight: torch.nn.functional.linear(x, w))
        out.append(Measured(f"gemm {rows}x{k}x{n}", ops.gemm(rows, k, n, b, b),
                            timed(fn, device, 3 if quick else 7), latency=rows * k * n <= 64**3))
    return out


def moe_points(active, dtype: torch.dtype, device: torch.device, quick: bool) -> list[Measured]:
    out = []
    for tokens, hidden, inter in ((256 if not quick else 64, 1024, 512), (1, 1024, 512),
                                  (1, 64, 32)):
        experts, top_k = 8, 2
        w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype).to(device)
        w2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype).to(device)
        x = torch.randn(tokens, hidden).to(dtype).to(device)
        ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(device)
        weights = torch.full((tokens, top_k), 1.0 / top_k, device=device)

        def fn(x=x, ids=ids, weights=weights, w13=w13, w2=w2):
            return active.ops.moe_experts(x, w13, w2, weights, ids)

        cost = ops.experts(tokens * top_k, tokens, experts, experts, top_k, hidden, inter,
                           dtype.itemsize, dtype.itemsize)
        total = OpCost("moe", sum(c.flops for c in cost), sum(c.bytes for c in cost),
                       hidden, inter)
        out.append(Measured(f"moe {tokens} tokens of {hidden}", total,
                            timed(fn, device, 3 if quick else 5), latency=hidden <= 64))
    return out


def norm_points(active, dtype: torch.dtype, device: torch.device, quick: bool) -> list[Measured]:
    tokens, hidden = (4096, 4096) if quick else (16384, 4096)  # 32 / 128 MiB in, as much out
    x = torch.randn(tokens, hidden).to(dtype).to(device)
    w = torch.ones(hidden, dtype=dtype, device=device)
    tiny, w_tiny = torch.randn(1, 64).to(dtype).to(device), w[:64].contiguous()
    return [Measured("rms_norm", ops.rms_norm(tokens, hidden, dtype.itemsize),
                     timed(lambda: active.ops.rms_norm(x, w, 1e-6), device, 5)),
            Measured("rms_norm 1x64", ops.rms_norm(1, 64, dtype.itemsize),
                     timed(lambda: active.ops.rms_norm(tiny, w_tiny, 1e-6), device, 7), latency=True)]


def _metadata(seqs: list[Seq], device: torch.device) -> tuple[AttentionMetadata, int]:
    """Block tables for `seqs` (each its own blocks) and the number of blocks."""
    query, lens, tables, next_block = [], [], [], 1
    for s in seqs:
        for _ in range(s.count):
            total = s.cached + s.new
            blocks = -(-total // BLOCK)
            tables.append(list(range(next_block, next_block + blocks)))
            next_block += blocks
            query.append(s.new)
            lens.append(total)
    return AttentionMetadata.build(query, lens, tables, BLOCK, device), next_block


def attention_points(active, kind: AttentionKind, dtype: torch.dtype, device: torch.device,
                     quick: bool) -> list[Measured]:
    """Full, sliding-window or MLA attention on the backend the engine would pick."""
    from tokenmill.model.layers import resolve_backends
    from tokenmill.platforms.interfaces import kv_cache_shape

    heads, kv, head = 8, 2, 128
    mla = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                  v_head_dim=128) if kind == AttentionKind.MLA else None
    window = 256 if kind == AttentionKind.SLIDING_WINDOW else None
    if mla is not None:
        spec = AttentionSpec(kind, heads, 1, 576, dtype, BLOCK, scale=0.07, mla=mla)
    else:
        spec = AttentionSpec(kind, heads, kv, head, dtype, BLOCK, sliding_window=window)
    backend = resolve_backends([spec], active.attention_backend)[0]
    # a prompt (compute), and decodes reading more KV than a cache holds (32 x 4096 tokens:
    # 128 MiB of bf16 keys and values over 2 KV heads of 128; MLA's latent rows: 144 MiB)
    decode = Seq(2048, 1, 8) if mla is not None or quick else Seq(4096, 1, 32)
    cases = [("prefill", [Seq(0, 256 if quick else 512)]), ("decode", [decode]),
             ("latency", [Seq(15, 1)])]
    out = []
    for phase, seqs in cases:
        metadata, blocks = _metadata(seqs, device)
        cache = torch.randn(kv_cache_shape(spec, blocks)).to(dtype).to(device)
        tokens = metadata.num_tokens
        if mla is not None:
            q = torch.randn(tokens, heads, 192).to(dtype).to(device)
            k = torch.randn(tokens, 1, 576).to(dtype).to(device)
            w_uk = torch.randn(heads, 128, 512).to(dtype).to(device) / 20
            w_uv = torch.randn(heads, 128, 512).to(dtype).to(device) / 20

            def fn(q=q, k=k, cache=cache, metadata=metadata, w_uk=w_uk, w_uv=w_uv):
                backend.prepare(metadata)
                return backend.forward(spec, q, k, None, cache, metadata, w_uk=w_uk, w_uv=w_uv)

            cost = ops.mla_attention(seqs, heads, 128, 64, 128, 512, dtype.itemsize, dtype.itemsize)
        else:
            q = torch.randn(tokens, heads, head).to(dtype).to(device)
            k = torch.randn(tokens, kv, head).to(dtype).to(device)
            v = torch.randn(tokens, kv, head).to(dtype).to(device)

            def fn(q=q, k=k, v=v, cache=cache, metadata=metadata):
                backend.prepare(metadata)
                return backend.forward(spec, q, k, v, cache, metadata)

            cost = ops.attention(seqs, heads, kv, head, head, dtype.itemsize, dtype.itemsize,
                                 window or 0)
        out.append(Measured(f"{cost.op} {phase} ({backend.name})", cost,
                            timed(fn, device, 3 if quick else 5), latency=phase == "latency"))
    return out


def recurrent_points(active, variant: str, dtype: torch.dtype, device: torch.device,
                     quick: bool) -> list[Measured]:
    """A Gated DeltaNet, KDA or Mamba2 layer's scan on the backend the engine would pick:
    a prompt (chunked) and a batch of decodes (the recurrent step)."""
    from tokenmill.model.layers import resolve_backends

    build = {"gated_delta": _gated_delta, "kda": _kda, "mamba2": _mamba2}[variant]
    out = []
    for phase, seqs in (("prefill", [Seq(0, 128 if quick else 512)]), ("decode", [Seq(100, 1, 16)]),
                        ("latency", [Seq(15, 1)])):
        spec, make_inputs, heads, dk, dv = build(dtype)
        backend = resolve_backends([spec], active.attention_backend)[0]
        n = sum(s.count for s in seqs)
        pages = 2 * n + 1
        page = -(-spec.state.num_bytes // 2) * 2
        cache = torch.zeros((2, pages, page // 2), dtype=torch.uint8, device=device)
        slots = [[1 + i] for i in range(n)]
        sources = [None if s.cached == 0 else [1 + i] for s in seqs for i in range(s.count)]
        metadata = recurrent_metadata(
            [s.new for s in seqs for _ in range(s.count)],
            [s.cached + s.new for s in seqs for _ in range(s.count)],
            RecurrentStateMetadata(slots, sources, [[] for _ in range(n)]), BLOCK, device)
        inputs = make_inputs(metadata.num_tokens, device)

        def fn(inputs=inputs, cache=cache, metadata=metadata, backend=backend, spec=spec):
            backend.prepare(metadata)
            return backend.forward(spec, inputs, cache, metadata)

        cost = ops.recurrent(seqs, heads, dk, dv, dtype.itemsize, variant)
        out.append(Measured(f"{cost.op} {phase} ({backend.name})", cost,
                            timed(fn, device, 3 if phase != "latency" else 7),
                            latency=phase == "latency"))
    return out


def _gated_delta(dtype):
    from tokenmill.platforms.ops.linear_attention import GatedDeltaInputs, gated_delta_state_spec

    hk, hv, dk, dv, kernel = 4, 8, 128, 128, 4
    conv = 2 * hk * dk + hv * dv
    state = gated_delta_state_spec(conv, kernel, hv, dk, dv, dtype)
    spec = AttentionSpec(AttentionKind.LINEAR, hv, hk, dk, dtype, BLOCK, state=state)

    def inputs(tokens, device):
        return GatedDeltaInputs(
            torch.randn(tokens, conv).to(dtype).to(device),
            -torch.rand(tokens, hv, device=device), torch.rand(tokens, hv).to(dtype).to(device),
            torch.randn(conv, kernel).to(dtype).to(device) / 2, None, hk, dk, hv, dv)
    return spec, inputs, hv, dk, dv


def _kda(dtype):
    from tokenmill.platforms.ops.linear_attention import KDAInputs, kda_state_spec

    heads, d, kernel = 8, 128, 4
    state = kda_state_spec(heads, d, kernel, dtype)
    spec = AttentionSpec(AttentionKind.LINEAR, heads, heads, d, dtype, BLOCK, state=state)

    def inputs(tokens, device):
        return KDAInputs(
            torch.randn(tokens, 3 * heads * d).to(dtype).to(device),
            -torch.rand(tokens, heads, d, device=device) / 10,
            torch.rand(tokens, heads).to(dtype).to(device),
            torch.randn(3 * heads * d, kernel).to(dtype).to(device) / 2, heads, d)
    return spec, inputs, heads, d, d


def _mamba2(dtype):
    from tokenmill.platforms.ops.mamba2 import (
        Mamba2Dims,
        Mamba2Inputs,
        Mamba2Weights,
        mamba2_state_spec,
    )

    dims = Mamba2Dims(num_heads=16, head_dim=64, num_groups=2, state_size=128, conv_kernel=4,
                      chunk_size=256)
    spec = AttentionSpec(AttentionKind.LINEAR, dims.num_heads, dims.num_groups, dims.head_dim,
                         dtype, BLOCK, state=mamba2_state_spec(dims, dtype))

    def inputs(tokens, device):
        weights = Mamba2Weights(
            torch.randn(dims.conv_dim, dims.conv_kernel).to(dtype).to(device) / 2, None,
            torch.zeros(dims.num_heads, dtype=dtype, device=device),
            -torch.rand(dims.num_heads, device=device), torch.ones(dims.num_heads, dtype=dtype,
                                                                    device=device))
        return Mamba2Inputs(torch.randn(tokens, dims.conv_dim).to(dtype).to(device),
                            torch.randn(tokens, dims.num_heads).to(dtype).to(device), weights, dims)
    return spec, inputs, dims.num_heads, dims.state_size, dims.head_dim


def all_points(active, quick: bool = False, dtype: torch.dtype | None = None) -> list[Measured]:
    """Every kernel class the platform runs, in `dtype` (None: the platform's default)."""
    platform = active.platform
    dtype, device = dtype or platform.default_dtype, platform.device
    caps = platform.capabilities
    points = gemm_points(active, dtype, device, quick)
    points += moe_points(active, dtype, device, quick) + norm_points(active, dtype, device, quick)
    for kind in (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW, AttentionKind.MLA):
        if kind in caps.attention_kinds or kind == AttentionKind.MLA:
            points += attention_points(active, kind, dtype, device, quick)
    for variant in ("gated_delta", "kda", "mamba2"):
        points += recurrent_points(active, variant, dtype, device, quick)
    return points
