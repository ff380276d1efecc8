"""T1 MLA: a declared multi-head latent attention backend against the core's reference
(`tokenmill.platforms.ops.mla.mla_attention`).

Only for platforms that declare `AttentionKind.MLA`. Paged, ragged batches mixing decodes,
prefill chunks after cached context and fresh prompts; every declared dtype and a spread of
block sizes; DeepSeek-like and odd dimensions; NaN in every unwritten latent slot;
several layers sharing one step's metadata (the runner's order of calls); chunked prefill
then decode over several steps on one cache.
"""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.platforms.interfaces import AttentionKind, MLADims, kv_cache_shape
from tokenmill.platforms.ops.mla import mla_attention
from tokenmill_conformance.attention_harness import (
    attention_op,
    describe_step,
    make_metadata,
    mixed_batch,
    shuffled_tables,
)
from tokenmill_conformance.errors import assert_matches
from tokenmill_conformance.mla_harness import check_mla_step, make_mla_step, mla_spec, mla_to_device
from tokenmill_conformance.suite.conftest import capabilities_of

DIMS = {
    "deepseek_like": MLADims(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                             v_head_dim=32),
    "odd": MLADims(kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=20),
}


def _block_sizes(caps) -> list[int]:
    sizes = sorted(caps.block_sizes)
    return sorted({sizes[0], min(sizes, key=lambda s: abs(s - 16)), sizes[-1]})


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames:
        return
    caps = capabilities_of(metafunc.config)
    cases: list[tuple] = []
    if caps is not None and AttentionKind.MLA in caps.attention_kinds:
        dtypes = sorted(caps.dtypes, key=str)
        if metafunc.function.__name__ == "test_mla_mixed_batches":
            cases = [(d, b, n) for d in dtypes for b in _block_sizes(caps) for n in DIMS]
        else:
            cases = [(d,) for d in dtypes]
    ids = ["-".join(str(p).removeprefix("torch.") for p in c) for c in cases]
    metafunc.parametrize("case", cases, ids=ids)


def _backend(active, spec):
    return active.attention_backend(spec)


# DeepSeek-V3 / Kimi K2: rank 512, rope 64, 16 heads (128 over eight tensor-parallel ranks)
PRODUCTION_DIMS = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128)
# a decode past 8k tokens of context, a prefill chunk after cached context, a fresh prompt
PRODUCTION_BATCH = [(8192 + 3, 1), (300, 40), (0, 17), (5, 1)]


def test_mla_production_shapes(active, case):
    """Rank 512 / rope 64 with 16 heads, every declared dtype, the largest declared block."""
    (dtype,) = case
    block = max(active.platform.capabilities.block_sizes)
    spec = mla_spec(dtype, block, num_heads=16, dims=PRODUCTION_DIMS,
                    scale=PRODUCTION_DIMS.qk_head_dim ** -0.5)
    step = make_mla_step(PRODUCTION_BATCH, spec, 11, poison=True)
    check_mla_step(_backend(active, spec), spec, mla_to_device(step, active.platform.device))


def test_mla_mixed_batches(active, quick, case):
    dtype, block_size, dims = case
    spec = mla_spec(dtype, block_size, num_heads=4, dims=DIMS[dims])
    backend = _backend(active, spec)
    for seed in range(1 if quick else 3):
        step = make_mla_step(mixed_batch(seed), spec, seed)
        check_mla_step(backend, spec, mla_to_device(step, active.platform.device))


def test_mla_unwritten_slots_are_never_read(active, case):
    (dtype,) = case
    caps = active.platform.capabilities
    for block_size in _block_sizes(caps):
        spec = mla_spec(dtype, block_size, num_heads=3)
        seqs = [(17, 1), (1, 1), (30, 3), (5, 6)] + mixed_batch(4)
        step = make_mla_step(seqs, spec, 1, poison=True)
        check_mla_step(_backend(active, spec), spec, mla_to_device(step, active.platform.device))


def test_mla_layers_share_one_prepare(active, case):
    """Three layers of one step after one `prepare`, each with its own cache and weights."""
    (dtype,) = case
    spec = mla_spec(dtype, min(active.platform.capabilities.block_sizes), num_heads=8)
    backend = _backend(active, spec)
    steps = [make_mla_step(mixed_batch(9), spec, seed) for seed in range(3)]
    device = active.platform.device
    steps = [mla_to_device(s, device) for s in steps]
    backend.prepare(steps[0].metadata)
    for step in steps:
        step.metadata = steps[0].metadata
        check_mla_step(backend, spec, step, prepare=False)


def test_mla_chunked_prefill_then_decode(active, case):
    """Two prompts prefilled in chunks, then decoded, over steps on one latent cache."""
    (dtype,) = case
    caps = active.platform.capabilities
    block = min(caps.block_sizes, key=lambda s: abs(s - 8))
    spec = mla_spec(dtype, block, num_heads=4)
    backend = _backend(active, spec)
    device = active.platform.device
    prompts, chunk, decodes = [37, 5], 10, 6
    totals = [p + decodes for p in prompts]
    tables, num_blocks = shuffled_tables([(0, t) for t in totals], block, random.Random(0))
    shape = kv_cache_shape(spec, num_blocks)
    cache = torch.zeros(tuple(backend.kv_cache_shape(spec, num_blocks)), dtype=dtype,
                        device=device)
    ref_cache = torch.zeros(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    dims = spec.mla
    w_uk = (torch.randn(4, dims.qk_nope_head_dim, dims.kv_lora_rank, generator=generator)
            * dims.kv_lora_rank**-0.5).to(dtype)
    w_uv = (torch.randn(4, dims.v_head_dim, dims.kv_lora_rank, generator=generator)
            * dims.kv_lora_rank**-0.5).to(dtype)
    done = [0, 0]
    while done != totals:
        seqs = []
        for i, prompt in enumerate(prompts):
            new = min(chunk, prompt - done[i]) if done[i] < prompt else 1
            seqs.append((done[i], min(new, totals[i] - done[i])))
        rows = [i for i in range(2) if seqs[i][1] > 0]
        seqs = [seqs[i] for i in rows]
        meta = make_metadata(seqs, tables[rows], block)
        n = meta.num_tokens
        q = torch.randn(n, 4, dims.qk_head_dim, generator=generator).to(dtype)
        latent = torch.randn(n, 1, dims.latent_size, generator=generator).to(dtype)
        expected = mla_attention(spec, q, latent, None, ref_cache, meta, w_uk=w_uk, w_uv=w_uv)
        device_meta = make_metadata(seqs, tables[rows], block)
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            setattr(device_meta, name, getattr(device_meta, name).to(device))
        backend.prepare(device_meta)
        out = backend.forward(spec, q.to(device), latent.to(device), None, cache, device_meta,
                              w_uk=w_uk.to(device), w_uv=w_uv.to(device))
        assert_matches(out, expected, op=attention_op(spec), dtype=dtype,
                       shape=f"rank {dims.kv_lora_rank}, " + describe_step(spec, meta))
        for i, (_, new) in zip(rows, seqs):
            done[i] += new
