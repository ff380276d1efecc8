"""T2 KV movement: block copy, swap out to host and back in, round trips, and attention
over moved blocks. The plugin's `copy_blocks` / `swap_blocks` (or the core's references,
when it does not override them) against the references in `tokenmill.platforms.ops.reference`."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.platforms.interfaces import AllocatorPurpose, AttentionKind, AttentionSpec
from tokenmill.platforms.ops import reference
from tokenmill.platforms.ops.reference import paged_attention
from tokenmill_conformance.attention_harness import TOLERANCE, check_step, make_step, to_device
from tokenmill_conformance.suite.conftest import capabilities_of


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dtype" in metafunc.fixturenames:
        caps = capabilities_of(metafunc.config)
        dtypes = [] if caps is None else sorted(caps.dtypes, key=str)
        metafunc.parametrize("dtype", dtypes, ids=[str(d).removeprefix("torch.") for d in dtypes])


def _caches(active, dtype, num_layers=3, num_blocks=12, seed=0) -> list[torch.Tensor]:
    caps = active.platform.capabilities
    block = min(caps.block_sizes, key=lambda s: abs(s - 16))
    head = min(caps.head_sizes)
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, num_blocks, block, 2, head, generator=g).to(dtype).to(active.platform.device)
        for _ in range(num_layers)
    ]


def _host_staging(active, like: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, object]:
    """A host cache of `num_blocks` blocks carved from the HOST_STAGING allocator."""
    allocator = active.allocator(AllocatorPurpose.HOST_STAGING)
    per_block = like[:, :1].numel() * like.element_size()
    buffer = allocator.allocate(per_block * num_blocks)
    cache = buffer.view(like.dtype).view(2, num_blocks, *like.shape[2:])
    cache.zero_()
    return cache, (allocator, buffer)


def test_copy_blocks_matches_reference(active, dtype):
    caches = _caches(active, dtype)
    expected = [c.cpu().clone() for c in caches]
    mapping = torch.tensor([[0, 5], [3, 7], [7, 1], [9, 9], [2, 11]], dtype=torch.int64)
    reference.copy_blocks(expected, mapping)
    active.ops.copy_blocks(caches, mapping.to(active.platform.device))
    for got, want in zip(caches, expected):
        assert torch.equal(got.cpu(), want), "copy_blocks differs from the reference"


def test_copy_blocks_empty_mapping_is_a_no_op(active, dtype):
    caches = _caches(active, dtype)
    before = [c.clone() for c in caches]
    active.ops.copy_blocks(caches, torch.zeros(0, 2, dtype=torch.int64))
    assert all(torch.equal(a, b) for a, b in zip(caches, before))


def test_swap_out_and_in_round_trip(active, dtype):
    """Device blocks -> host staging -> other device blocks: bit-exact, nothing else moves."""
    (cache,) = _caches(active, dtype, num_layers=1, num_blocks=16)
    original = cache.clone()
    host, (allocator, buffer) = _host_staging(active, cache, 6)
    try:
        out_map = torch.tensor([[4, 0], [9, 1], [15, 5], [0, 2]])
        active.ops.swap_blocks(cache, host, out_map)
        expected_host = torch.zeros_like(host.cpu())
        reference.swap_blocks(original.cpu(), expected_host, out_map)
        assert torch.equal(host.cpu(), expected_host), "swap out differs from the reference"
        assert torch.equal(cache, original), "swap_blocks modified its source"
        in_map = torch.tensor([[0, 1], [1, 2], [5, 3], [2, 12]])
        active.ops.swap_blocks(host, cache, in_map)
        expected = original.cpu().clone()
        reference.swap_blocks(expected_host, expected, in_map)
        assert torch.equal(cache.cpu(), expected), "swap in differs from the reference"
        for src, dst in zip((4, 9, 15, 0), (1, 2, 3, 12)):
            assert torch.equal(cache[:, dst], original[:, src]), "round trip is not bit-exact"
    finally:
        allocator.free(buffer)


def test_attention_over_swapped_and_copied_blocks(active, dtype):
    """A step's context moved out, back into other blocks, and shared by copy: attention
    through the new block tables equals the reference's."""
    caps = active.platform.capabilities
    kind = AttentionKind.FULL if AttentionKind.FULL in caps.attention_kinds else None
    if kind is None:
        pytest.skip("full attention is not declared")
    block = min(caps.block_sizes, key=lambda s: abs(s - 8))
    spec = AttentionSpec(kind, 4, 2, min(caps.head_sizes), dtype, block)
    seqs = [(3 * block + 2, 1), (block, 5)]
    step = to_device(make_step(seqs, spec, seed=3), active.platform.device)
    unmoved = make_step(seqs, spec, seed=3)
    expected = paged_attention(
        spec, unmoved.query, unmoved.key, unmoved.value, unmoved.kv_cache, unmoved.metadata
    )
    tables = step.metadata.block_tables
    used = sorted({int(b) for row, (c, n) in zip(tables, seqs)
                   for b in row[: -(-(c + n) // block)]})
    num_blocks = step.kv_cache.shape[1]
    free = [b for b in range(num_blocks) if b not in used]
    host, (allocator, buffer) = _host_staging(active, step.kv_cache, len(used))
    try:
        out_map = torch.tensor([[b, i] for i, b in enumerate(used)])
        active.ops.swap_blocks(step.kv_cache, host, out_map)
        # Move every used block to a new id: blocks are swapped back in a rotated order.
        rng = random.Random(0)
        targets = used[:]
        rng.shuffle(targets)
        while targets == used and len(used) > 1:
            rng.shuffle(targets)
        step.kv_cache.fill_(0)
        active.ops.swap_blocks(host, step.kv_cache, torch.tensor(
            [[i, t] for i, t in enumerate(targets)]))
        relabel = dict(zip(used, targets))
        step.metadata.block_tables = tables.cpu().apply_(lambda b: relabel.get(b, b)).to(
            tables.device)
        if free:  # share the first sequence's first block by copy into a free block
            first = int(step.metadata.block_tables[0, 0])
            active.ops.copy_blocks([step.kv_cache], torch.tensor([[first, free[0]]]))
            step.metadata.block_tables[0, 0] = free[0]
        slots = step.metadata.slot_mapping.cpu()
        new_slots = [
            int(step.metadata.block_tables[i, p // block]) * block + p % block
            for i, (c, n) in enumerate(seqs) for p in range(c, c + n)
        ]
        assert len(new_slots) == slots.numel()
        step.metadata.slot_mapping = torch.tensor(new_slots, dtype=torch.int64).to(
            step.metadata.slot_mapping.device)
        out = check_step(active.attention_backend(spec), spec, step)
        torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[dtype], msg=lambda m: (
            f"attention over the moved blocks differs from attention before the move: {m}"))
    finally:
        allocator.free(buffer)
