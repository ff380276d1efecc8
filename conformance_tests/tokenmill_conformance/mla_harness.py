"""Random paged, ragged MLA steps and the comparison with the core's reference MLA.

As in `attention_harness` (whose metadata and shuffled block tables it reuses): a step
is (cached tokens, new tokens) per sequence, blocks are shuffled across sequences, and
with `poison=True` every latent slot no sequence wrote holds NaN. The cache has the
standard MLA layout, [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], unless
the backend declares another in `kv_cache_shape` (then the same bytes in its view).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
    MLADims,
    kv_cache_shape,
)
from tokenmill.platforms.ops.mla import mla_attention
from tokenmill_conformance.attention_harness import (
    attention_op,
    describe_step,
    kv_scales,
    make_metadata,
    same_cache,
    shuffled_tables,
)
from tokenmill_conformance.errors import assert_matches


def mla_spec(
    dtype: torch.dtype,
    block_size: int,
    num_heads: int = 4,
    dims: MLADims = MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=16),
    scale: float = 0.2,
) -> AttentionSpec:
    return AttentionSpec(
        AttentionKind.MLA, num_heads, 1, dims.latent_size, dtype, block_size, scale=scale,
        mla=dims,
    )


@dataclass(slots=True)
class MLAStep:
    query: torch.Tensor  # [T, H, nope + rope]
    latent: torch.Tensor  # [T, 1, rank + rope]
    w_uk: torch.Tensor  # [H, nope, rank]
    w_uv: torch.Tensor  # [H, v, rank]
    kv_cache: torch.Tensor  # [num_blocks, block_size, rank + rope]
    metadata: AttentionMetadata


def make_mla_step(
    seqs: list[tuple[int, int]], spec: AttentionSpec, seed: int = 0, poison: bool = False
) -> MLAStep:
    """Random values from `seed` (weights scaled so scores spread but stay finite)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    dims = spec.mla
    tables, num_blocks = shuffled_tables(seqs, spec.block_size, rng)
    metadata = make_metadata(seqs, tables, spec.block_size)

    def randn(*size: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * std).to(spec.dtype)

    shape = kv_cache_shape(spec, num_blocks)
    kv_cache = randn(*shape).to(spec.kv_dtype)  # an FP8 cache: stored values, scale apart
    if poison:
        written = torch.full(shape, float("nan"), dtype=spec.kv_dtype)
        for i, (cached, _) in enumerate(seqs):
            for p in range(cached):
                block, offset = int(tables[i, p // spec.block_size]), p % spec.block_size
                written[block, offset] = kv_cache[block, offset]
        kv_cache = written
    heads, rank = spec.num_heads, dims.kv_lora_rank
    return MLAStep(
        query=randn(metadata.num_tokens, heads, dims.qk_head_dim),
        latent=randn(metadata.num_tokens, 1, dims.latent_size),
        w_uk=randn(heads, dims.qk_nope_head_dim, rank, std=rank**-0.5),
        w_uv=randn(heads, dims.v_head_dim, rank, std=rank**-0.5),
        kv_cache=kv_cache,
        metadata=metadata,
    )


def mla_to_device(step: MLAStep, device: torch.device) -> MLAStep:
    meta = step.metadata
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(device))
    return MLAStep(
        step.query.to(device), step.latent.to(device), step.w_uk.to(device),
        step.w_uv.to(device), step.kv_cache.to(device), meta,
    )


def check_mla_step(
    backend: AttentionBackend, spec: AttentionSpec, step: MLAStep, prepare: bool = True
) -> torch.Tensor:
    """One MLA layer of `backend` against the reference on a copy of the step; returns the
    backend's output. The cache is handed over in the backend's declared shape."""
    meta = step.metadata
    ref_meta = make_metadata(
        [(s - q, q) for s, q in zip(meta.seq_lens_cpu, meta.query_lens_cpu)],
        meta.block_tables.cpu(), spec.block_size,
    )
    ref_cache = step.kv_cache.cpu().clone()
    weights = dict(w_uk=step.w_uk.cpu(), w_uv=step.w_uv.cpu())
    scales = kv_scales(spec)  # a quantized latent cache's k_scale (and unused v_scale)
    expected = mla_attention(
        spec, step.query.cpu(), step.latent.cpu(), None, ref_cache, ref_meta, **weights, **scales
    )
    num_blocks = step.kv_cache.shape[0]
    declared = tuple(backend.kv_cache_shape(spec, num_blocks))
    assert declared and torch.Size(declared).numel() == step.kv_cache.numel(), (
        f"the backend's kv_cache_shape {declared} does not hold the {num_blocks} blocks of "
        f"an MLA page of {spec.block_size} x {spec.head_size} values"
    )
    cache_view = step.kv_cache.view(*declared)
    inputs = (step.query.clone(), step.latent.clone())
    if prepare:
        backend.prepare(meta)
    extra = {name: t.to(step.kv_cache.device) for name, t in scales.items()}
    out = backend.forward(spec, *inputs, None, cache_view, meta, w_uk=step.w_uk, w_uv=step.w_uv,
                          **extra)
    dims = spec.mla
    assert out.shape == (meta.num_tokens, spec.num_heads, dims.v_head_dim), (
        f"output shape {tuple(out.shape)}"
    )
    assert out.dtype == step.query.dtype, f"output dtype {out.dtype}, query {step.query.dtype}"
    assert torch.isfinite(out).all(), (
        "the output holds NaN/inf although the reference's is finite: the backend let latent "
        "slots that no sequence wrote into its result"
    )
    shape = f"rank {dims.kv_lora_rank} / rope {dims.qk_rope_head_dim}, " + describe_step(spec, meta)
    assert_matches(out, expected, op=attention_op(spec), shape=shape, dtype=spec.dtype)
    assert same_cache(step.kv_cache.cpu(), ref_cache), (
        "the latent cache after the step differs from the reference's (rows written to the "
        "wrong slots, or slots outside slot_mapping modified)"
    )
    for before, after, name in zip((step.query, step.latent), inputs, ("query", "key")):
        assert torch.equal(before, after), f"forward modified its input {name}"
    return out
