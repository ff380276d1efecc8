"""The CPU plugin against the core's references: attention, allocators, collectives."""

from __future__ import annotations

from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenmill.platforms.interfaces import (
    AllocatorPurpose,
    AttentionKind,
    AttentionSpec,
    Communicator,
    OutOfMemoryError,
)
from tokenmill.platforms.ops.reference import paged_attention
from tokenmill.platforms.registry import load_platform
from tokenmill_conformance.attention_harness import kv_scales, make_step, mixed_batch, same_cache
from tokenmill_cpu import hardware, kernels
from tokenmill_cpu.allocator import KVCACHE_ENV, make_allocator
from tokenmill_cpu.attention import CpuPagedAttention
from tokenmill_cpu.communicator import SingleProcessCommunicator

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def check_against_reference(
    spec: AttentionSpec, seqs, seed: int = 0, num_layers: int = 2, use_kernels: bool = True
) -> CpuPagedAttention:
    """Runs `num_layers` layers on one step's metadata, as the model runner does; decode rows
    go to the C++ kernel (when built) or, with use_kernels=False, to SDPA. An FP8 cache
    (`spec.cache_dtype`) gets a distinct k and v scale per KV head. Returns the backend
    (its `rows_by_path` says which paths ran)."""
    backend = CpuPagedAttention(spec.kind, use_kernels=use_kernels)
    if use_kernels and kernels.enabled():
        assert backend._kernels is not None, "the C++ kernels did not build"
    assert backend.supports(spec)
    steps = [make_step(seqs, spec, seed + layer, table_seed=seed) for layer in range(num_layers)]
    metadata = steps[0].metadata
    scales = kv_scales(spec)
    backend.prepare(metadata)
    for step in steps:
        query, key, value, kv_cache = step.query, step.key, step.value, step.kv_cache
        ref_cache = kv_cache.clone()
        expected = paged_attention(spec, query, key, value, ref_cache, metadata, **scales)
        inputs = (query.clone(), key.clone(), value.clone())
        out = backend.forward(spec, *inputs, kv_cache, metadata, **scales)
        assert out.shape == query.shape and out.dtype == query.dtype
        torch.testing.assert_close(out, expected, **TOLERANCE[spec.dtype])
        assert same_cache(kv_cache, ref_cache), "the KV cache differs from the reference's"
        assert all(torch.equal(a, b) for a, b in zip(inputs, (query, key, value), strict=True))
    return backend


# -- attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_full_attention_matches_reference_on_mixed_batches(
    dtype, num_heads, num_kv_heads, block_size, use_kernels
):
    spec = AttentionSpec(AttentionKind.FULL, num_heads, num_kv_heads, 64, dtype, block_size)
    for seed in range(2):
        check_against_reference(spec, mixed_batch(seed), seed, use_kernels=use_kernels)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [1, 5, 24, 500])
@pytest.mark.parametrize("block_size", [8, 32])
def test_sliding_window_matches_reference(dtype, window, block_size, use_kernels):
    spec = AttentionSpec(
        AttentionKind.SLIDING_WINDOW, 6, 2, 32, dtype, block_size, sliding_window=window
    )
    for seed in range(2):
        check_against_reference(spec, mixed_batch(seed + 10), seed, use_kernels=use_kernels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [32, 80, 128, 256])
def test_head_sizes_and_custom_scale(head_size, dtype):
    spec = AttentionSpec(AttentionKind.FULL, 4, 1, head_size, dtype, 16, scale=0.3)
    check_against_reference(spec, mixed_batch(3))


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("window", [None, 5, 37, 600])
@pytest.mark.parametrize(
    "seqs",
    [
        [(999, 1)],  # one long decode: its keys split between threads, merged after
        [(700, 1), (1200, 1)],  # two, split into different numbers of parts
        [(n - 1, 1) for n in (1, 2, 15, 16, 17, 33)],  # few decodes: a kv head per item
        [(n - 1, 1) for n in (1, 2, 15, 16, 17, 33, 100, 250, 31, 64, 7, 129)],  # per sequence
        [(0, 100), (37, 70), (5, 1), (300, 2)],  # prompt and chunks over several row blocks
        [(0, 33)] * 3 + [(16, 64)] * 6 + [(90, 1)] * 4,  # many row blocks: every kv head per item
    ],
    ids=[
        "split-decode",
        "split-decodes",
        "decodes-per-head",
        "decodes-per-sequence",
        "chunks",
        "chunks-per-sequence",
    ],
)
def test_bf16_kernel_tiles_windows_and_work_split(head_size, window, seqs):
    """The kernel's bf16 path (head sizes 64 and 128) for decodes and prefill chunks: spans
    that end mid-tile, windows that start mid-block, chunks longer than a 32-row block
    after cached context, every way of splitting the work (by kv head, by sequence, long
    decodes by keys)."""
    kind = AttentionKind.FULL if window is None else AttentionKind.SLIDING_WINDOW
    spec = AttentionSpec(kind, 8, 2, head_size, torch.bfloat16, 16, sliding_window=window)
    check_against_reference(spec, seqs, seed=len(seqs))


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 1)],  # a one-token prompt
        [(0, 77)],  # one fresh prompt: causal over the step's own keys
        [(63, 1)] * 5,  # equal decodes: no padding mask
        [(200, 1), (3, 1), (90, 1), (15, 1), (140, 1), (7, 1)],  # decodes of very different spans
        [(16, 16), (31, 33)],  # chunks on and off block boundaries
    ],
)
@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "sdpa"])
def test_edge_shapes(seqs, use_kernels):
    for kind, window in ((AttentionKind.FULL, None), (AttentionKind.SLIDING_WINDOW, 9)):
        spec = AttentionSpec(kind, 6, 3, 64, torch.float32, 16, sliding_window=window)
        check_against_reference(spec, seqs, use_kernels=use_kernels)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.skipif(not kernels.enabled(), reason="TOKENMILL_CPU_KERNELS=0")
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "kind, window",
    [(AttentionKind.FULL, None), (AttentionKind.SLIDING_WINDOW, 5),
     (AttentionKind.SLIDING_WINDOW, 24)],
    ids=["full", "window5", "window24"],
)
@pytest.mark.parametrize("num_heads, num_kv_heads, block_size", [(9, 3, 16), (8, 2, 8)])
def test_fp8_cache_decodes_in_the_kernel_and_matches_reference(
    kv_dtype, dtype, kind, window, num_heads, num_kv_heads, block_size
):
    """An FP8 cache with a distinct scale per KV head: decode rows go to the C++ kernel,
    which reads the FP8 codes in place (never the dequantizing gather), and every row,
    prefill chunks over cached context and fresh prompts included, equals the reference's
    FP8 attention (dequantize, then attend)."""
    spec = AttentionSpec(kind, num_heads, num_kv_heads, 64, dtype, block_size,
                         sliding_window=window, cache_dtype=kv_dtype)
    for seed in range(2):
        seqs = mixed_batch(seed + 20)
        backend = check_against_reference(spec, seqs, seed)
        decodes = sum(1 for _, new in seqs if new == 1)  # a 1-token prompt is one too
        assert backend.rows_by_path["sdpa_decode"] == 0, "FP8 decode rows fell back to the gather"
        assert backend.rows_by_path["kernel_decode"] == 2 * decodes > 0


@pytest.mark.skipif(not kernels.enabled(), reason="TOKENMILL_CPU_KERNELS=0")
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
@pytest.mark.parametrize("window", [None, 37])
def test_fp8_decode_only_step_runs_no_gather(kv_dtype, window):
    """A step of decodes only (long, short, one split over the window) over an FP8 cache is
    all kernel: no row reaches SDPA, and the step's plan gathers nothing."""
    kind = AttentionKind.FULL if window is None else AttentionKind.SLIDING_WINDOW
    spec = AttentionSpec(kind, 9, 3, 64, torch.bfloat16, 16, sliding_window=window,
                         cache_dtype=kv_dtype)
    seqs = [(n - 1, 1) for n in (1, 2, 15, 16, 17, 33, 100, 250, 999)]
    backend = check_against_reference(spec, seqs, seed=5, num_layers=3)
    assert backend.rows_by_path == {"kernel_decode": 3 * len(seqs)}


@pytest.mark.skipif(not kernels.enabled(), reason="TOKENMILL_CPU_KERNELS=0")
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_fp8_decode_kernel_reads_every_code_exactly(kv_dtype):
    """All 256 codes of the format (NaN and, for e5m2, inf included) as values of 4 one-key
    sequences (zero keys: each output is its value row times v_scale) come out as torch's
    own conversion: the kernel's vectorised decoding and its table agree with it bit for bit."""
    module = kernels.load()
    assert module is not None, "the C++ kernels did not build"
    codes = torch.arange(256, dtype=torch.uint8).view(torch.uint8).view(4, 1, 64)
    kv_cache = torch.zeros(2, 4, 16, 1, 64, dtype=torch.uint8)
    kv_cache[1, :, 0] = codes
    kv_cache = kv_cache.view(kv_dtype)
    query = torch.randn(4, 1, 64)
    out = torch.empty_like(query)
    module.decode_attention_fp8(
        query, kv_cache, torch.arange(4, dtype=torch.int32).view(4, 1),
        torch.ones(4, dtype=torch.int32), torch.arange(4), 0, 0.125,
        torch.tensor([0.5]), torch.tensor([1.0]), out,
    )
    want = codes.view(kv_dtype).float()
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_fp8_without_kernels_decodes_through_the_gather(kv_dtype):
    """The fallback (TOKENMILL_CPU_KERNELS=0, or a failed build) still matches the reference
    and is counted as such, so the kernel test above would see a silent fallback."""
    spec = AttentionSpec(AttentionKind.FULL, 9, 3, 64, torch.bfloat16, 16, cache_dtype=kv_dtype)
    backend = check_against_reference(spec, mixed_batch(7), seed=7, use_kernels=False)
    assert backend.rows_by_path["kernel_decode"] == 0 and backend.rows_by_path["sdpa_decode"] > 0


def test_layers_with_different_windows_share_one_step():
    seqs = mixed_batch(5)
    step = make_step(seqs, AttentionSpec(AttentionKind.SLIDING_WINDOW, 4, 2, 32, torch.float32, 16))
    query, key, value, kv_cache, metadata = (
        step.query, step.key, step.value, step.kv_cache, step.metadata
    )
    backend = CpuPagedAttention(AttentionKind.SLIDING_WINDOW)
    backend.prepare(metadata)
    for window in (4, 64, 4):
        spec = AttentionSpec(
            AttentionKind.SLIDING_WINDOW, 4, 2, 32, torch.float32, 16, sliding_window=window
        )
        expected = paged_attention(spec, query, key, value, kv_cache.clone(), metadata)
        torch.testing.assert_close(
            backend.forward(spec, query, key, value, kv_cache, metadata), expected
        )


def test_supports_declares_what_it_runs():
    full = CpuPagedAttention(AttentionKind.FULL)
    sliding = CpuPagedAttention(AttentionKind.SLIDING_WINDOW)
    spec = AttentionSpec(AttentionKind.FULL, 8, 2, 64, torch.bfloat16, 16)
    assert full.supports(spec) and not sliding.supports(spec)
    assert not full.supports(AttentionSpec(AttentionKind.FULL, 8, 2, 64, torch.float16, 16))
    assert not full.supports(AttentionSpec(AttentionKind.FULL, 8, 3, 64, torch.float32, 16))
    windowed = AttentionSpec(
        AttentionKind.SLIDING_WINDOW, 8, 2, 64, torch.float32, 16, sliding_window=8
    )
    assert sliding.supports(windowed) and not full.supports(windowed)
    with pytest.raises(ValueError, match="not AttentionKind.MLA|not mla"):
        CpuPagedAttention(AttentionKind.MLA)


def test_active_platform_routes_each_kind_to_its_backend():
    active = load_platform("cpu")
    for kind, window in ((AttentionKind.FULL, None), (AttentionKind.SLIDING_WINDOW, 128)):
        spec = AttentionSpec(
            kind, 9, 3, 64, active.platform.default_dtype, 16, sliding_window=window
        )
        assert active.attention_backend(spec).kind == kind


# -- platform, hardware spec, allocators -------------------------------------------------


def test_default_dtype_follows_the_cpu_flags():
    platform = load_platform("cpu").platform
    native = hardware.has_native_bf16(hardware.cpu_flags())
    assert platform.default_dtype == (torch.bfloat16 if native else torch.float32)
    assert platform.memory_info().total_bytes >= platform.memory_info().free_bytes > 0


def test_hardware_spec_estimate_and_overrides(monkeypatch):
    spec = load_platform("cpu").hardware_spec()
    assert spec.peak_flops["bfloat16"] >= spec.peak_flops["float32"] > 0
    assert spec.memory_bandwidth > 0 and spec.memory_bytes > 0
    monkeypatch.setenv(hardware.PEAK_FP32_ENV, "250")
    monkeypatch.setenv(hardware.BANDWIDTH_ENV, "40")
    spec = hardware.estimate_hardware_spec()
    assert spec.peak_flops["float32"] == 250e9 and spec.memory_bandwidth == 40e9
    monkeypatch.setenv(hardware.BANDWIDTH_ENV, "fast")
    with pytest.raises(ValueError, match="TOKENMILL_CPU_MEMORY_BANDWIDTH_GBS='fast'"):
        hardware.estimate_hardware_spec()


def test_kv_allocator_limit_accounting_oom_and_double_free(monkeypatch):
    monkeypatch.setenv(KVCACHE_ENV, "0.001")
    allocator = load_platform("cpu").allocator(AllocatorPurpose.KV_ARENA)
    limit = allocator.bytes_limit()
    assert limit == int(0.001 * (1 << 30))
    first = allocator.allocate(1000)
    assert first.dtype == torch.uint8 and first.numel() == 1000
    second = allocator.allocate(limit - 1000)
    assert allocator.bytes_in_use() == limit
    with pytest.raises(
        OutOfMemoryError,
        match=rf"cannot allocate 1 bytes .*: 0 bytes .* {limit}-byte limit .*{KVCACHE_ENV}",
    ):
        allocator.allocate(1)
    allocator.free(first)
    assert allocator.bytes_in_use() == limit - 1000
    with pytest.raises(OutOfMemoryError, match=r"cannot allocate 1001 bytes .*: 1000 bytes"):
        allocator.allocate(1001)
    with pytest.raises(ValueError, match="already freed"):
        allocator.free(first)
    with pytest.raises(ValueError, match="not allocated by this allocator"):
        allocator.free(torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="already freed or was not allocated"):
        allocator.free(second[10:])
    allocator.free(second)
    assert allocator.bytes_in_use() == 0


def test_allocator_limits_from_available_memory_and_bad_env(monkeypatch):
    monkeypatch.delenv(KVCACHE_ENV, raising=False)
    for purpose in AllocatorPurpose:
        allocator = make_allocator(purpose)
        assert allocator.purpose is purpose and allocator.bytes_limit() > 0
    monkeypatch.setenv(KVCACHE_ENV, "-2")
    with pytest.raises(ValueError, match=r"TOKENMILL_CPU_KVCACHE_GIB='-2' must be a positive"):
        make_allocator(AllocatorPurpose.KV_ARENA)
    with pytest.raises(ValueError, match="num_bytes=0"):
        make_allocator(AllocatorPurpose.WEIGHTS).allocate(0)


# -- communicator ------------------------------------------------------------------------


def test_single_process_communicator_without_torch_distributed():
    assert not dist.is_initialized()
    comm = load_platform("cpu").communicator()
    assert isinstance(comm, SingleProcessCommunicator)
    x = torch.arange(6.0).view(2, 3)
    assert comm.world_size == 1 and comm.rank == 0
    assert torch.equal(comm.all_reduce(x), x) and torch.equal(comm.all_gather(x, dim=1), x)
    assert torch.equal(comm.reduce_scatter(x), x) and torch.equal(comm.all_to_all(x), x)
    with pytest.raises(ValueError, match="no peer"):
        comm.send(x, 1)


def _collectives_worker(rank: int, store_path: str) -> None:
    """Runs every collective on a 2-rank gloo group; raises (failing the spawn) on a mismatch."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    try:
        active = load_platform("cpu")
        for group in (None, dist.new_group([0, 1])):
            comm = active.communicator(group)
            _check_collectives(comm, rank)
    finally:
        dist.destroy_process_group()


def _check_collectives(comm, rank: int) -> None:
    other = 1 - rank
    assert (comm.rank, comm.world_size) == (rank, 2)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.full((3, 4), rank + 1.0, dtype=dtype)
        assert torch.equal(comm.all_reduce(x), torch.full((3, 4), 3.0, dtype=dtype))
    strided = torch.full((4, 3), rank + 1.0).t()
    assert torch.equal(comm.all_reduce(strided), torch.full((3, 4), 3.0))

    x = torch.full((2, 3), float(rank))
    assert torch.equal(comm.all_gather(x), torch.cat([torch.zeros(2, 3), torch.ones(2, 3)]))
    assert torch.equal(
        comm.all_gather(x, dim=1), torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], 1)
    )

    x = torch.arange(12.0).view(4, 3) * (rank + 1)
    before = x.clone()
    expected = torch.arange(12.0).view(4, 3) * 3
    assert torch.equal(comm.reduce_scatter(x), expected[2 * rank : 2 * rank + 2])
    assert torch.equal(
        comm.reduce_scatter(x.t().contiguous(), dim=1), expected.t()[:, 2 * rank : 2 * rank + 2]
    )
    assert torch.equal(x, before), "reduce_scatter modified its input"

    x = torch.arange(4.0) + 10 * rank  # chunk i of every rank goes to rank i
    assert torch.equal(
        comm.all_to_all(x), torch.tensor([2.0 * rank, 2 * rank + 1, 10 + 2 * rank, 11 + 2 * rank])
    )

    # uneven: rank 0 sends 1 row to itself and 3 to rank 1; rank 1 sends 2 and 0
    sends = [[1, 3], [2, 0]][rank]
    recvs = [[1, 2], [3, 0]][rank]
    x = torch.arange(4.0 if rank == 0 else 2.0).unsqueeze(1) + 10 * rank
    want = [torch.tensor([[0.0], [10.0], [11.0]]), torch.tensor([[1.0], [2.0], [3.0]])][rank]
    assert torch.equal(comm.all_to_all_single(x, recvs, sends), want)
    # the interface's default (all_gather + padded all_to_all) agrees with gloo's alltoallv
    assert torch.equal(Communicator.all_to_all_single(comm, x, recvs, sends), want)

    if rank == 0:
        comm.send(torch.arange(5.0), dst=other)
        assert torch.equal(comm.recv(torch.empty(5), src=other), torch.arange(5.0) * 2)
    else:
        received = comm.recv(torch.empty(5), src=other)
        comm.send(received * 2, dst=other)

    x = torch.full((3,), float(rank))
    assert torch.equal(comm.broadcast(x, src=1), torch.ones(3))
    comm.barrier()


def test_gloo_collectives_in_a_real_two_process_group(tmp_path):
    mp.spawn(_collectives_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)


def test_kv_arena_default_leaves_the_machine_usable(monkeypatch):
    """10% of the machine's memory, never more than 40% of what is available."""
    monkeypatch.delenv(KVCACHE_ENV, raising=False)
    before = psutil.virtual_memory()
    limit = make_allocator(AllocatorPurpose.KV_ARENA).bytes_limit()
    after = psutil.virtual_memory()
    assert limit <= 0.1 * before.total
    assert limit <= 0.4 * max(before.available, after.available)
    assert limit >= min(0.1 * before.total, 0.4 * min(before.available, after.available)) - 1
