"""Random paged, ragged attention steps and the comparison with the core's reference.

A step is described by (cached tokens, new tokens) per sequence. Blocks are shuffled
across sequences (block 0 included), so a backend that reads a wrong block gets a wrong
answer. With `poison=True` every slot that no sequence has written holds NaN, including
the tail of each sequence's last partial block: a backend that lets unwritten slots
into its output produces NaN.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import accumulate

import torch

from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.ops.reference import paged_attention
from tokenmill_conformance.errors import ATTENTION_BOUNDS, assert_matches

# Per-dtype elementwise tolerances of attention outputs against the float32-math reference
# (the statistics on top: tokenmill_conformance.errors).
TOLERANCE = {dtype: dict(atol=b.atol, rtol=b.rtol) for dtype, b in ATTENTION_BOUNDS.items()}


@dataclass(slots=True)
class Step:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata


def make_metadata(
    seqs: list[tuple[int, int]], tables: torch.Tensor, block_size: int
) -> AttentionMetadata:
    """The step's metadata for sequences with (cached, new) tokens and these block tables."""
    slots = []
    for i, (cached, new) in enumerate(seqs):
        slots += [
            int(tables[i, p // block_size]) * block_size + p % block_size
            for p in range(cached, cached + new)
        ]
    query_lens = [new for _, new in seqs]
    seq_lens = [cached + new for cached, new in seqs]
    return AttentionMetadata(
        num_tokens=sum(query_lens),
        num_seqs=len(seqs),
        query_start_loc=torch.tensor([0, *accumulate(query_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )


def shuffled_tables(
    seqs: list[tuple[int, int]], block_size: int, rng: random.Random, spare: int = 2
) -> tuple[torch.Tensor, int]:
    """(block tables padded with 0, number of blocks in the cache)."""
    needed = [-(-(cached + new) // block_size) for cached, new in seqs]
    num_blocks = sum(needed) + spare
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = torch.zeros(len(seqs), max(needed) + 1, dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    return tables, num_blocks


def make_step(
    seqs: list[tuple[int, int]],
    spec: AttentionSpec,
    seed: int = 0,
    poison: bool = False,
    table_seed: int | None = None,
) -> Step:
    """Random values from `seed`; block tables from `table_seed` (default: `seed`), so the
    layers of one step can share its tables."""
    rng = random.Random(seed if table_seed is None else table_seed)
    generator = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_tables(seqs, spec.block_size, rng)
    metadata = make_metadata(seqs, tables, spec.block_size)
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(spec.dtype)

    kv_cache = randn(*shape).to(spec.kv_dtype)  # an FP8 cache: stored values, scale apart
    if poison:
        written = torch.full(shape, float("nan"), dtype=spec.kv_dtype)
        for i, (cached, _) in enumerate(seqs):
            for p in range(cached):
                block, offset = int(tables[i, p // spec.block_size]), p % spec.block_size
                written[:, block, offset] = kv_cache[:, block, offset]
        kv_cache = written
    num_tokens = metadata.num_tokens
    return Step(
        query=randn(num_tokens, spec.num_heads, spec.head_size),
        key=randn(num_tokens, spec.num_kv_heads, spec.head_size),
        value=randn(num_tokens, spec.num_kv_heads, spec.head_size),
        kv_cache=kv_cache,
        metadata=metadata,
    )


def mixed_batch(seed: int) -> list[tuple[int, int]]:
    """Decodes, prefill chunks after cached context, fresh prompts and a 1-token prompt."""
    rng = random.Random(seed)
    decodes = [(rng.randint(1, 90), 1) for _ in range(rng.randint(3, 9))]
    chunks = [(rng.randint(1, 60), rng.randint(2, 40)) for _ in range(2)]
    prompts = [(0, rng.randint(2, 50)), (0, 1)]
    batch = decodes + chunks + prompts
    rng.shuffle(batch)
    return batch


def to_device(step: Step, device: torch.device) -> Step:
    meta = step.metadata
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(device))
    return Step(
        step.query.to(device), step.key.to(device), step.value.to(device),
        step.kv_cache.to(device), meta,
    )


def check_step(
    backend: AttentionBackend,
    spec: AttentionSpec,
    step: Step,
    prepare: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer of `backend` against the reference on a copy of the same step; returns
    the backend's output. `sinks` (float32 [num_heads], for a spec with sinks) goes to
    both; so do the per-head `kv_scales(spec)` of a quantized cache (`spec.cache_dtype`),
    which is compared byte for byte after the step."""
    device = step.kv_cache.device
    ref_meta = make_metadata(
        list(zip(
            [s - q for s, q in zip(step.metadata.seq_lens_cpu, step.metadata.query_lens_cpu)],
            step.metadata.query_lens_cpu,
        )),
        step.metadata.block_tables.cpu(),
        spec.block_size,
    )
    ref_cache = step.kv_cache.cpu().clone()
    ref_sinks = None if sinks is None else sinks.cpu()
    scales = kv_scales(spec)
    expected = paged_attention(
        spec, step.query.cpu(), step.key.cpu(), step.value.cpu(), ref_cache, ref_meta, ref_sinks,
        **scales,
    )
    inputs = (step.query.clone(), step.key.clone(), step.value.clone())
    if prepare:
        backend.prepare(step.metadata)
    extra = {name: t.to(device) for name, t in scales.items()}
    if sinks is not None:
        extra["sinks"] = sinks.to(device)
    out = backend.forward(spec, *inputs, step.kv_cache, step.metadata, **extra)
    assert out.shape == step.query.shape, f"output shape {tuple(out.shape)}"
    assert out.dtype == step.query.dtype, f"output dtype {out.dtype}, query {step.query.dtype}"
    assert out.device == device
    assert torch.isfinite(out).all(), (
        "the output holds NaN/inf although the reference's is finite: the backend let KV "
        "slots that no sequence wrote (e.g. the tail of a last partial block) into its result"
    )
    assert_matches(out, expected, op=attention_op(spec), shape=describe_step(spec, step.metadata),
                   dtype=spec.dtype)
    assert same_cache(step.kv_cache.cpu(), ref_cache), (
        "the KV cache after the step differs from the reference's (keys/values written to "
        "the wrong slots, or slots outside slot_mapping modified)"
    )
    for before, after, name in zip((step.query, step.key, step.value), inputs, "qkv"):
        assert torch.equal(before, after), f"forward modified its input {name}"
    return out


def kv_scales(spec: AttentionSpec) -> dict[str, torch.Tensor]:
    """The `k_scale` / `v_scale` keywords for a quantized cache ({} otherwise): a distinct
    scale per KV head (so a backend that applies one head's scale to all, or none, fails),
    one for an MLA latent row."""
    if spec.cache_dtype is None:
        return {}
    heads = torch.arange(spec.num_kv_heads, dtype=torch.float32)
    return {"k_scale": 0.5 + 0.25 * heads, "v_scale": 1.5 - 0.5 * heads / spec.num_kv_heads}


def same_cache(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal caches, NaN slots alike: byte for byte for FP8, else with NaN read as 7."""
    if got.dtype.itemsize == 1:
        return torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def attention_op(spec: AttentionSpec) -> str:
    """The op's name in failure messages: 'attention (full)', 'attention (mla)',
    'attention (sliding_window 24)'."""
    cache = "" if spec.cache_dtype is None else f", {str(spec.cache_dtype).removeprefix('torch.')} KV"
    if spec.kind is AttentionKind.SLIDING_WINDOW:
        return f"attention (sliding_window {spec.sliding_window}{cache})"
    return f"attention ({spec.kind.value}{', sinks' if spec.sinks else ''}{cache})"


def describe_step(spec: AttentionSpec, metadata: AttentionMetadata) -> str:
    """The shape in failure messages: heads, head size, block size and the batch."""
    seqs = [(s - q, q) for s, q in zip(metadata.seq_lens_cpu, metadata.query_lens_cpu)]
    batch = str(seqs) if len(seqs) <= 6 else (
        f"{len(seqs)} sequences, longest context {max(s for s, _ in seqs)}, longest query "
        f"{max(q for _, q in seqs)}")
    return (f"{spec.num_heads} query / {spec.num_kv_heads} kv heads x head size "
            f"{spec.head_size}, block size {spec.block_size}, (cached, new) {batch}")
