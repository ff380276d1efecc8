"""T1 quantized KV cache: every FP8 KV dtype the platform declares
(`Capabilities.kv_cache_dtypes`), on every attention kind that stores KV (full, sliding
window, MLA latents), against the core's reference (`tokenmill.platforms.ops.kv_quant`).

The reference and the backend get the same FP8 cache and the same per-head scales (a
distinct one per KV head), so the only difference allowed is the compute dtype's rounding:
the outputs are held to the same error statistics as unquantized attention, and the cache
after the step must equal the reference's byte for byte (keys and values saturated and
rounded the reference's way, into the right slots). Unwritten slots hold NaN. A platform
that declares no KV dtype has nothing to certify here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill_conformance.attention_harness import check_step, make_step, mixed_batch, to_device
from tokenmill_conformance.mla_harness import check_mla_step, make_mla_step, mla_spec, mla_to_device
from tokenmill_conformance.suite.conftest import capabilities_of

KINDS = (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW, AttentionKind.MLA)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames:
        return
    caps = capabilities_of(metafunc.config)
    cases = []
    if caps is not None:
        kinds = sorted((k for k in caps.attention_kinds if k in KINDS), key=str)
        cases = [
            (k, d, kv) for k in kinds for d in sorted(caps.dtypes, key=str)
            for kv in sorted(caps.kv_cache_dtypes, key=str)
        ]
    ids = [f"{k.value}-{_name(d)}-{_name(kv)}" for k, d, kv in cases]
    metafunc.parametrize("case", cases, ids=ids)


def _block_size(caps) -> int:
    return min(caps.block_sizes, key=lambda s: abs(s - 16))


def test_quantized_kv_matches_the_reference(active, quick, case):
    """Mixed batches (decodes, chunks after cached context, fresh prompts) over two layers
    sharing the step's metadata, NaN in every unwritten slot."""
    kind, dtype, kv_dtype = case
    caps = active.platform.capabilities
    device = active.platform.device
    block = _block_size(caps)
    seeds = range(1 if quick else 2)
    if kind is AttentionKind.MLA:
        spec = dataclasses.replace(mla_spec(dtype, block), cache_dtype=kv_dtype)
        backend = active.attention_backend(spec)
        for seed in seeds:
            step = mla_to_device(make_mla_step(mixed_batch(seed), spec, seed, poison=True), device)
            check_mla_step(backend, spec, step)
        return
    head = 64 if 64 in caps.head_sizes else min(caps.head_sizes)
    window = 9 if kind is AttentionKind.SLIDING_WINDOW else None
    spec = AttentionSpec(kind, 8, 2, head, dtype, block, window, cache_dtype=kv_dtype)
    backend = active.attention_backend(spec)
    assert kv_dtype in backend.kv_cache_dtypes, (
        f"the platform declares {kv_dtype} KV caches but its {kind.value} backend "
        f"{backend.name!r} does not list it in kv_cache_dtypes"
    )
    for seed in seeds:
        steps = [to_device(make_step(mixed_batch(seed), spec, seed + i, poison=True,
                                     table_seed=seed), device) for i in range(2)]
        backend.prepare(steps[0].metadata)
        for step in steps:
            step.metadata = steps[0].metadata
            check_step(backend, spec, step, prepare=False)
