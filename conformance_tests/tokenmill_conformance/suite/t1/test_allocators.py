"""T1 allocators: exact sizes, accounting, reuse, limits and out-of-memory behaviour."""

from __future__ import annotations

import pytest
import torch

from tokenmill.platforms.interfaces import AllocatorPurpose, OutOfMemoryError

PURPOSES = list(AllocatorPurpose)


@pytest.mark.parametrize("purpose", PURPOSES, ids=lambda p: p.value)
def test_allocate_exact_sizes_and_account(active, purpose):
    allocator = active.allocator(purpose)
    base = allocator.bytes_in_use()
    buffers = [allocator.allocate(n) for n in (1, 4096, 12345)]
    for buffer, n in zip(buffers, (1, 4096, 12345)):
        assert buffer.dtype == torch.uint8 and buffer.numel() == n and buffer.dim() == 1
        assert buffer.device.type == active.platform.device_type or (
            purpose is AllocatorPurpose.HOST_STAGING and buffer.device.type == "cpu"
        ), f"{purpose.value} buffer on {buffer.device}"
    assert allocator.bytes_in_use() == base + 1 + 4096 + 12345
    buffers[1].fill_(7)
    assert int(buffers[1].sum()) == 7 * 4096, "a buffer must be usable memory"
    for buffer in buffers:
        allocator.free(buffer)
    assert allocator.bytes_in_use() == base


@pytest.mark.parametrize("purpose", PURPOSES, ids=lambda p: p.value)
def test_reuse_after_free(active, purpose):
    allocator = active.allocator(purpose)
    base = allocator.bytes_in_use()
    for _ in range(50):
        allocator.free(allocator.allocate(1 << 20))
    assert allocator.bytes_in_use() == base, "freed memory was not given back"


@pytest.mark.parametrize("purpose", PURPOSES, ids=lambda p: p.value)
def test_out_of_memory_past_the_limit(active, purpose):
    allocator = active.allocator(purpose)
    base = allocator.bytes_in_use()
    free = allocator.bytes_limit() - base
    with pytest.raises(OutOfMemoryError):
        allocator.allocate(free + 1)
    assert allocator.bytes_in_use() == base, "a failed allocation must not be accounted"
    small = allocator.allocate(1024)  # still usable after an out-of-memory error
    allocator.free(small)


@pytest.mark.parametrize("purpose", PURPOSES, ids=lambda p: p.value)
def test_double_free_is_an_error(active, purpose):
    allocator = active.allocator(purpose)
    buffer = allocator.allocate(256)
    allocator.free(buffer)
    base = allocator.bytes_in_use()
    with pytest.raises((ValueError, RuntimeError)):
        allocator.free(buffer)
    assert allocator.bytes_in_use() == base


@pytest.mark.parametrize("purpose", [AllocatorPurpose.KV_ARENA, AllocatorPurpose.WEIGHTS],
                         ids=lambda p: p.value)
def test_sleep_mode_frees_and_restores(active, purpose):
    """With `capabilities.sleep_mode` (what `LLM.sleep` relies on): sleep frees every live
    buffer's bytes, views stay valid objects, allocating while asleep is refused, and wake
    restores the contents when asked to keep them (level 1 weights), zeroes otherwise."""
    if not active.platform.capabilities.sleep_mode:
        pytest.skip("the platform declares no sleep mode")
    allocator = active.allocator(purpose)
    buffer = allocator.allocate(4096)
    try:
        pattern = (torch.arange(4096) % 251).to(torch.uint8).to(buffer.device)
        view = buffer[1024:].view(torch.int32)
        for keep in (True, False):
            buffer.copy_(pattern)
            freed = allocator.sleep(keep_contents=keep)
            assert freed >= 4096, f"sleep freed {freed} bytes, the buffer alone holds 4096"
            assert buffer.untyped_storage().nbytes() == 0, "the buffer's memory was not freed"
            with pytest.raises(RuntimeError, match="asleep"):
                allocator.allocate(16)
            with pytest.raises(RuntimeError, match="already asleep"):
                allocator.sleep(keep_contents=keep)
            allocator.wake()
            expected = pattern if keep else torch.zeros_like(pattern)
            assert torch.equal(buffer.cpu(), expected.cpu()), f"contents after wake (keep={keep})"
            assert torch.equal(view.cpu(), expected[1024:].view(torch.int32).cpu()), (
                "a view taken before sleep does not see the woken buffer")
            with pytest.raises(RuntimeError, match="not asleep"):
                allocator.wake()
    finally:
        allocator.free(buffer)
