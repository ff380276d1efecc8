"""T1 attention: every declared attention kind against the core's reference paged attention.

Paged, ragged batches mixing decodes, prefill chunks and fresh prompts; chunked prefill
then decode over several steps on one cache; every declared dtype (per-dtype tolerances),
head size, a spread of block sizes, GQA ratios and sliding windows; NaN in every unwritten
KV slot; and property-based cases drawn by hypothesis from the declared capabilities.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill.platforms.ops.reference import paged_attention
from tokenmill.platforms.registry import PlatformError
from tokenmill_conformance.attention_harness import (
    attention_op,
    check_step,
    describe_step,
    make_metadata,
    make_step,
    mixed_batch,
    shuffled_tables,
    to_device,
)
from tokenmill_conformance.errors import assert_matches
from tokenmill_conformance.suite.conftest import capabilities_of

REFERENCE_KINDS = (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW)
GQA = [(4, 4), (8, 2), (9, 3)]
EDGE_BATCHES = {
    "one_token_prompt": [(0, 1)],
    "fresh_prompt": [(0, 77)],
    "equal_decodes": [(63, 1)] * 5,
    "spread_decodes": [(200, 1), (3, 1), (90, 1), (15, 1), (140, 1), (7, 1)],
    "chunks_on_and_off_block_boundaries": [(16, 16), (31, 33)],
    "last_partial_block": [(17, 1), (1, 1), (30, 3), (5, 6)],
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _block_sizes(caps) -> list[int]:
    sizes = sorted(caps.block_sizes)
    middle = min(sizes, key=lambda s: abs(s - 16))
    return sorted({sizes[0], middle, sizes[-1]})


def _head_size(caps) -> int:
    return 64 if 64 in caps.head_sizes else min(caps.head_sizes)


def _test_dtype(caps) -> torch.dtype:
    return torch.float32 if torch.float32 in caps.dtypes else sorted(caps.dtypes, key=str)[0]


def _window(kind: AttentionKind, window: int = 24) -> int | None:
    return window if kind is AttentionKind.SLIDING_WINDOW else None


def _cases(name: str, caps) -> list:
    """The parameters of test `name`, from the declared capabilities."""
    if caps is None:
        return []
    kinds = sorted((k for k in caps.attention_kinds if k in REFERENCE_KINDS), key=str)
    dtypes = sorted(caps.dtypes, key=str)
    if name == "test_mixed_batches":
        return [
            (k, d, f"block{b}", h)
            for k in kinds for d in dtypes for b in _block_sizes(caps) for h in GQA
        ]
    if name == "test_head_sizes":
        return [(k, f"head{h}") for k in kinds for h in sorted(caps.head_sizes)]
    if name == "test_edge_batches":
        return [(k, e) for k in kinds for e in EDGE_BATCHES]
    if name == "test_sliding_windows":
        return [f"window{w}" for w in (1, 5, 24, 500) if AttentionKind.SLIDING_WINDOW in kinds]
    if name == "test_windows_never_read_blocks_they_left":
        if AttentionKind.SLIDING_WINDOW not in kinds:
            return []
        return [(d, f"window{w}") for d in dtypes for w in (5, 24)]
    if name in (
        "test_unwritten_slots_are_never_read", "test_chunked_prefill_then_decode", "test_sinks"
    ):
        return [(k, d) for k in kinds for d in dtypes]
    return []


def _id(case) -> str:
    """Readable ids: full-float32-block16-heads8x2, full-head64, sliding_window-fresh_prompt."""
    parts = case if isinstance(case, tuple) else (case,)
    words = []
    for part in parts:
        if isinstance(part, AttentionKind):
            words.append(part.value)
        elif isinstance(part, torch.dtype):
            words.append(_name(part))
        elif isinstance(part, tuple):
            words.append(f"heads{part[0]}x{part[1]}")
        else:
            words.append(str(part))
    return "-".join(words)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        cases = _cases(metafunc.function.__name__, capabilities_of(metafunc.config))
        metafunc.parametrize("case", cases, ids=[_id(c) for c in cases])


def _run(active, spec: AttentionSpec, seqs, seed: int = 0, poison: bool = False, layers=2):
    """`layers` layers sharing one step's metadata, as the model runner calls them."""
    backend = active.attention_backend(spec)
    device = active.platform.device
    steps = [
        to_device(make_step(seqs, spec, seed + i, poison, table_seed=seed), device)
        for i in range(layers)
    ]
    backend.prepare(steps[0].metadata)
    for step in steps:
        step.metadata = steps[0].metadata
        check_step(backend, spec, step, prepare=False)


def test_every_declared_kind_has_a_reference(active):
    declared = active.platform.capabilities.attention_kinds
    # LINEAR's reference and checks are in test_linear_attention.py, MLA's (tokenmill.platforms.ops.mla)
    # in test_mla.py
    with_reference = (*REFERENCE_KINDS, AttentionKind.LINEAR, AttentionKind.MLA)
    missing = sorted(k.value for k in declared if k not in with_reference)
    assert not missing, (
        f"the platform declares {missing} attention, which this core has no reference for; "
        "it cannot be certified until the core adds one"
    )


def test_mixed_batches(active, quick, case):
    kind, dtype, block, (heads, kv_heads) = case
    block_size = int(block.removeprefix("block"))
    head = _head_size(active.platform.capabilities)
    spec = AttentionSpec(kind, heads, kv_heads, head, dtype, block_size, _window(kind))
    for seed in range(1 if quick else 3):
        _run(active, spec, mixed_batch(seed), seed)


def test_head_sizes(active, case):
    kind, head = case[0], int(case[1].removeprefix("head"))
    dtype = _test_dtype(active.platform.capabilities)
    block = _block_sizes(active.platform.capabilities)[0]
    spec = AttentionSpec(kind, 4, 1, head, dtype, block, _window(kind), scale=0.3)
    _run(active, spec, mixed_batch(3))


def test_edge_batches(active, case):
    kind, edge = case
    caps = active.platform.capabilities
    block = min(caps.block_sizes, key=lambda s: abs(s - 16))
    spec = AttentionSpec(
        kind, 6, 3, _head_size(caps), _test_dtype(caps), block, _window(kind, 9)
    )
    _run(active, spec, EDGE_BATCHES[edge])


def test_sliding_windows(active, case):
    caps = active.platform.capabilities
    spec = AttentionSpec(
        AttentionKind.SLIDING_WINDOW, 6, 2, _head_size(caps), _test_dtype(caps),
        min(caps.block_sizes), sliding_window=int(case.removeprefix("window")),
    )
    _run(active, spec, mixed_batch(10), 1)


def test_sinks(active, case):
    """Attention sinks (gpt-oss), where a backend declares them: one learned logit per head
    in every query's softmax. A platform without them is not failed: the core runs such
    layers on its reference attention."""
    kind, dtype = case
    caps = active.platform.capabilities
    spec = AttentionSpec(
        kind, 8, 2, _head_size(caps), dtype, min(caps.block_sizes), _window(kind, 7), sinks=True
    )
    try:
        backend = active.attention_backend(spec)
    except PlatformError:
        backend = None
    if backend is None or not backend.supports_sinks:
        pytest.skip("no attention backend declares sinks; the core's reference runs them")
    device = active.platform.device
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(0)) * 2
    step = to_device(make_step(mixed_batch(5), spec, 0, poison=True), device)
    check_step(backend, spec, step, sinks=sinks)


def test_windows_never_read_blocks_they_left(active, case):
    """The core gives a window's blocks back once no query reads them, and its table then
    names the null block there (a page another request may be writing). Here every block
    wholly before a sequence's window holds NaN: none of it may reach the output."""
    dtype, window = case[0], int(case[1].removeprefix("window"))
    caps = active.platform.capabilities
    block = min(caps.block_sizes)
    spec = AttentionSpec(
        AttentionKind.SLIDING_WINDOW, 6, 2, _head_size(caps), dtype, block, window
    )
    seqs = mixed_batch(7) + [(120, 1), (90, 17), (64, 3)]
    step = make_step(seqs, spec, 3)
    for i, (cached, _) in enumerate(seqs):
        first_block = max(0, cached - window + 1) // block  # the first query is at `cached`
        for j in range(first_block):
            step.kv_cache[:, int(step.metadata.block_tables[i, j])] = float("nan")
    check_step(active.attention_backend(spec), spec, to_device(step, active.platform.device))


def test_unwritten_slots_are_never_read(active, case):
    """Every KV slot no sequence has written holds NaN (as fresh device memory may)."""
    kind, dtype = case
    caps = active.platform.capabilities
    for block_size in _block_sizes(caps):
        spec = AttentionSpec(kind, 8, 2, _head_size(caps), dtype, block_size, _window(kind, 5))
        _run(active, spec, EDGE_BATCHES["last_partial_block"] + mixed_batch(4), poison=True)


def test_chunked_prefill_then_decode(active, case):
    """Two prompts prefilled in chunks, then decoded, over steps on one cache."""
    kind, dtype = case
    caps = active.platform.capabilities
    block = min(caps.block_sizes, key=lambda s: abs(s - 8))
    spec = AttentionSpec(kind, 4, 2, _head_size(caps), dtype, block, _window(kind, 11))
    backend = active.attention_backend(spec)
    device = active.platform.device
    prompts, chunk, decodes = [37, 5], 10, 6
    totals = [p + decodes for p in prompts]
    tables, num_blocks = shuffled_tables([(0, t) for t in totals], block, random.Random(0))
    shape = (2, num_blocks, block, spec.num_kv_heads, spec.head_size)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    ref_cache = torch.zeros(shape, dtype=dtype)
    done = [0, 0]
    generator = torch.Generator().manual_seed(0)
    while done != totals:
        seqs = []
        for i, prompt in enumerate(prompts):
            new = min(chunk, prompt - done[i]) if done[i] < prompt else 1
            seqs.append((done[i], min(new, totals[i] - done[i])))
        seqs = [s for s in seqs if s[1] > 0]
        rows = [i for i in range(2) if done[i] < totals[i]]
        meta = make_metadata(seqs, tables[rows], block)
        n = meta.num_tokens
        q, k, v = (
            torch.randn(n, h, spec.head_size, generator=generator).to(dtype)
            for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)
        )
        expected = paged_attention(spec, q, k, v, ref_cache, meta)
        device_meta = make_metadata(seqs, tables[rows], block)
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            setattr(device_meta, name, getattr(device_meta, name).to(device))
        backend.prepare(device_meta)
        out = backend.forward(spec, q.to(device), k.to(device), v.to(device), cache, device_meta)
        assert_matches(out, expected, op=attention_op(spec), shape=describe_step(spec, meta),
                       dtype=dtype)
        for i, (_, new) in zip(rows, seqs):
            done[i] += new


def test_property_random_steps(active, quick):
    """Random steps and specs drawn from the declared capabilities (hypothesis)."""
    caps = active.platform.capabilities
    kinds = sorted((k for k in caps.attention_kinds if k in REFERENCE_KINDS), key=str)
    if not kinds:
        pytest.skip("no attention kind with a core reference is declared")
    seq = st.tuples(st.integers(0, 70), st.integers(1, 24))

    @settings(
        max_examples=12 if quick else 80,
        deadline=None,
        derandomize=True,
        database=None,
        # quick runs skip shrinking: a failure is reported as found, not minimised
        phases=[Phase.explicit, Phase.reuse, Phase.generate] if quick else list(Phase),
        suppress_health_check=list(HealthCheck),
    )
    @given(
        kind=st.sampled_from(kinds),
        dtype=st.sampled_from(sorted(caps.dtypes, key=str)),
        block_size=st.sampled_from(sorted(caps.block_sizes)),
        head_size=st.sampled_from(sorted(caps.head_sizes)),
        kv_heads=st.sampled_from([1, 2, 3]),
        group=st.sampled_from([1, 2, 4]),
        window=st.integers(1, 64),
        seqs=st.lists(seq, min_size=1, max_size=6),
        seed=st.integers(0, 2**16),
    )
    def check(kind, dtype, block_size, head_size, kv_heads, group, window, seqs, seed):
        spec = AttentionSpec(
            kind, kv_heads * group, kv_heads, head_size, dtype, block_size, _window(kind, window)
        )
        _run(active, spec, seqs, seed, layers=1)

    check()
