"""KV memory: the pool is sized from the platform's memory_info after the weights and a
profiling step (memory_utilization, vLLM's rule), kv_cache_memory_bytes and num_kv_blocks
win, and the arena is not zeroed: an arena full of NaN gives the same tokens."""

from __future__ import annotations

import dataclasses

import pluggy
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kv.arena import KVArena
from tokenmill.kv.sizing import kv_cache_budget
from tokenmill.model.loader import load_model_info
from tokenmill.model.registry import attention_specs_for
from tokenmill.platforms.interfaces import MemoryInfo
from tokenmill.platforms.kit.host_allocator import HostAllocator
from tokenmill.platforms.registry import PlatformRegistry
from tokenmill_conformance import reference_platform

MIB = 1 << 20
hookimpl = pluggy.HookimplMarker("tokenmill")


def test_budget_follows_vllms_rule():
    start, now = MemoryInfo(100 * MIB, 90 * MIB), MemoryInfo(100 * MIB, 70 * MIB)
    # may use 90 in all, the engine already holds 20: 70 left; 70 free - 10 kept: 60
    assert kv_cache_budget(start, now, 0.9).num_bytes == 60 * MIB
    # other processes took memory meanwhile: only what is free (minus the reserve) counts
    assert kv_cache_budget(start, MemoryInfo(100 * MIB, 15 * MIB), 0.9).num_bytes == 5 * MIB
    assert kv_cache_budget(start, now, 0.5).num_bytes == 20 * MIB
    assert "memory_utilization 0.5" in kv_cache_budget(start, now, 0.5).explanation
    with pytest.raises(ValueError, match="memory_utilization=0"):
        kv_cache_budget(start, now, 0)


class SmallDevice:
    """The reference platform on a pretend 1 MiB device whose memory_info behaves like a
    caching allocator's: free = total - the KV allocator's high-water mark (so the
    profiling step's scratch cache shows as used)."""

    TOTAL = MIB

    def __init__(self) -> None:
        self.kv: HostAllocator | None = None
        self.peak = 0

    def memory_info(self) -> MemoryInfo:
        if self.kv is not None:
            self.peak = max(self.peak, self.kv.bytes_in_use())
        return MemoryInfo(self.TOTAL, self.TOTAL - self.peak)

    @hookimpl
    def tokenmill_api_version(self):
        return "1.3"

    @hookimpl
    def tokenmill_detect(self):
        return reference_platform.tokenmill_detect()

    @hookimpl
    def tokenmill_platform(self):
        base = reference_platform.tokenmill_platform()
        return dataclasses.replace(base, name="small", memory_info=self.memory_info)

    @hookimpl
    def tokenmill_attention_backends(self, platform):
        return reference_platform.tokenmill_attention_backends(platform)

    @hookimpl
    def tokenmill_allocator(self, platform, purpose):
        allocator = HostAllocator(purpose, self.TOTAL, "the test device's memory", owner="small")
        if purpose.value == "kv_arena":
            self.kv = allocator
            original = allocator.allocate

            def allocate(num_bytes):  # a caching allocator keeps its peak reserved
                buffer = original(num_bytes)
                self.memory_info()
                return buffer

            allocator.allocate = allocate
        return allocator

    @hookimpl
    def tokenmill_hardware_spec(self, platform):
        return reference_platform.tokenmill_hardware_spec(platform)


def _small_llm(path, **kw) -> tuple[LLM, SmallDevice]:
    device = SmallDevice()
    registry = PlatformRegistry()
    registry.register_plugin(device, "small")
    llm = LLM(str(path), platform="small", registry=registry, dtype="float32", block_size=4,
              max_num_seqs=8, max_num_batched_tokens=64, **kw)
    return llm, device


def _block_bytes(path) -> int:
    hf_config = load_model_info(str(path), load_tokenizer=False).hf_config
    return KVArena.block_bytes_for(attention_specs_for(hf_config, torch.float32, 4))


def test_pool_is_sized_from_memory_info_after_the_profiling_step(tiny_dirs):
    path = tiny_dirs["llama"]
    block = _block_bytes(path)
    llm, device = _small_llm(path, memory_utilization=0.5)
    # the profiling step prefilled 64 tokens over 8 sequences: 16 blocks of scratch cache
    assert device.peak >= 16 * block
    expected = (SmallDevice.TOTAL // 2 - 16 * block) // block
    assert llm.engine.num_kv_blocks == min(expected, 8 * -(-llm.engine.max_model_len // 4))
    smaller, _ = _small_llm(path, memory_utilization=0.2)
    assert smaller.engine.num_kv_blocks < llm.engine.num_kv_blocks


def test_explicit_sizes_win(tiny_dirs):
    path = tiny_dirs["llama"]
    block = _block_bytes(path)
    llm, device = _small_llm(path, kv_cache_memory_bytes=40 * block + 5, memory_utilization=0.1)
    assert llm.engine.num_kv_blocks == 40
    assert device.peak == 40 * block  # no profiling step: the size was given
    llm, _ = _small_llm(path, num_kv_blocks=33, kv_cache_memory_bytes=1)
    assert llm.engine.num_kv_blocks == 33


def test_too_little_memory_is_a_clear_error(tiny_dirs):
    with pytest.raises(ValueError, match="holds no block .* raise memory_utilization"):
        _small_llm(tiny_dirs["llama"], memory_utilization=0.01)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_arena_full_of_nan_gives_the_same_tokens(tiny_dirs, dtype):
    """Unwritten KV slots are never read into a result (the CPU kernels mask them), so the
    arena needs no zeroing: filled with NaN bit patterns it gives identical tokens, through
    chunked prefill, decodes of mixed lengths and prefix-cache hits."""
    kw = {"dtype": dtype, "block_size": 8, "num_kv_blocks": 96, "platform": "cpu",
          "max_num_batched_tokens": 24}
    prompts = ["The quick brown fox", "Paris is the capital of France; Berlin is",
               "def main():", "Paris is the capital of France; Berlin is not"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    clean = LLM(str(tiny_dirs["qwen3"]), **kw)
    poisoned = LLM(str(tiny_dirs["qwen3"]), **kw)
    poisoned.engine.executor.worker.arena.buffer.fill_(0xFF)  # NaN in every dtype
    for batch in (prompts[:3], prompts[3:]):  # the second batch hits the first's prefix
        want = clean.generate(batch, params, use_tqdm=False)
        got = poisoned.generate(batch, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[0].num_cached_tokens > 0
