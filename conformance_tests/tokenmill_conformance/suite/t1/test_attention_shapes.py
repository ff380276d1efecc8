"""T1 attention at production shapes: head sizes 64/128/256, GQA ratios 1/4/8, every
declared dtype and block size, windows shorter and longer than a block (a deterministic
sample of the product with its corners, `tokenmill_conformance.shapes`), and long contexts
past every kernel's path switch: decodes past 2,048 and 8k tokens and a prefill chunk
after 8k tokens of context.

Each case is one step of two layers sharing one `prepare`, NaN in every KV slot no
sequence wrote, compared with the core's reference by the max-error bound and the error
statistics (`tokenmill_conformance.errors`), so a 1% scale or bias fails in bfloat16.
"""

from __future__ import annotations

import pytest

from tokenmill.platforms.interfaces import AttentionSpec
from tokenmill_conformance.attention_harness import check_step, make_step, to_device
from tokenmill_conformance.shapes import (
    LONG_BATCHES,
    NUM_KV_HEADS,
    long_cases,
    production_cases,
    sweep_batch,
)
from tokenmill_conformance.suite.conftest import capabilities_of, conformance_of

EXTRA_CASES = 12  # sampled beyond the corners and coverage; 6 in a quick run


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    caps = capabilities_of(metafunc.config)
    if "shape_case" in metafunc.fixturenames:
        quick = conformance_of(metafunc.config).quick
        cases = [] if caps is None else production_cases(caps, EXTRA_CASES // (2 if quick else 1))
        metafunc.parametrize("shape_case", cases, ids=[c.id for c in cases])
    if "long_case" in metafunc.fixturenames:
        cases = [] if caps is None else long_cases(caps)
        metafunc.parametrize("long_case", cases, ids=[c.id for c in cases])


def _run_layers(active, spec: AttentionSpec, seqs: list[tuple[int, int]], seed: int) -> None:
    """Two layers of one step, sharing one `prepare` and the step's block tables."""
    backend = active.attention_backend(spec)
    device = active.platform.device
    steps = [to_device(make_step(seqs, spec, seed + i, poison=True, table_seed=seed), device)
             for i in range(2)]
    backend.prepare(steps[0].metadata)
    for step in steps:
        step.metadata = steps[0].metadata
        check_step(backend, spec, step, prepare=False)


def test_production_shapes(active, shape_case):
    case = shape_case
    spec = AttentionSpec(case.kind, NUM_KV_HEADS * case.group, NUM_KV_HEADS, case.head_size,
                         case.dtype, case.block_size, case.window_tokens())
    _run_layers(active, spec, sweep_batch(case.block_size), seed=case.head_size + case.group)


def test_long_context(active, long_case):
    case = long_case
    # one KV head: the long steps cost the most; the sweep covers the head mapping
    spec = AttentionSpec(case.kind, case.group, 1, case.head_size, case.dtype,
                         case.block_size, case.window_tokens())
    _run_layers(active, spec, LONG_BATCHES[case.scenario], seed=7)
