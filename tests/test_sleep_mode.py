"""Sleep mode through `LLM` on the cpu plugin (its host allocators): greedy output identical
before sleep and after wake at both levels, the memory really released while asleep,
requests while asleep refused with a clear error, and the misuse errors."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import EngineSleepingError
from tokenmill.platforms.interfaces import AllocatorPurpose

PROMPTS = [{"prompt_token_ids": list(range(start, start + n))}
           for start, n in ((5, 3), (40, 11), (80, 19))]  # no shared prefixes


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


def _worker(llm: LLM):
    return llm.engine.executor.worker


@pytest.mark.parametrize("level,dtype", [(1, "float32"), (2, "bfloat16")])
def test_greedy_output_survives_sleep_and_wake(tiny_dirs, level, dtype):
    llm = LLM(str(tiny_dirs["llama"]), dtype=dtype, platform="cpu", block_size=4,
              num_kv_blocks=64)
    before = _generate(llm)
    again = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert any(o.num_cached_tokens > 0 for o in again)  # the prefix cache hits before sleep
    model = _worker(llm).runner.model
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    arena = _worker(llm).platform.allocator(AllocatorPurpose.KV_ARENA)
    llm.sleep(level=level)
    assert llm.is_sleeping()
    # every parameter's memory and the KV arena's are released, the objects stay valid
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert arena.sleeping and all(b.untyped_storage().nbytes() == 0
                                  for b in arena._live.values())
    with pytest.raises(EngineSleepingError, match="asleep .*wake_up"):
        llm.generate(PROMPTS[:1], greedy(), use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), f"{name} differs after wake (level {level})"
    after = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == before
    # the KV cache was discarded, so nothing of before the sleep counts as a prefix hit
    assert all(o.num_cached_tokens == 0 for o in after)
    assert _generate(llm) == before  # and the cache works again after the wake


def test_misuse_is_refused(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), dtype="float32", platform="cpu", block_size=4,
              num_kv_blocks=32)
    with pytest.raises(ValueError, match="sleep level 3 is not one of"):
        llm.sleep(level=3)
    with pytest.raises(RuntimeError, match="not asleep"):
        llm.wake_up()
    engine = llm.engine
    engine.add_request("busy", list(range(5, 12)), greedy())
    with pytest.raises(RuntimeError, match="1 requests in flight"):
        llm.sleep()
    while engine.has_unfinished_requests():
        engine.step()
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="already asleep"):
        llm.sleep()
    with pytest.raises(EngineSleepingError):
        engine.add_request("late", [5, 6, 7], greedy())
    llm.wake_up()
    assert len(_generate(llm)) == 3


def test_shutdown_gives_the_weights_back_to_the_allocator(tiny_dirs):
    """The weights allocator keeps its live buffers alive: an engine that goes must free
    the ones sleep mode gave its parameters, or every engine of a process would leak."""
    llm = LLM(str(tiny_dirs["llama"]), dtype="float32", platform="cpu", block_size=4,
              num_kv_blocks=16)
    worker = _worker(llm)
    weights = worker.platform.allocator(AllocatorPurpose.WEIGHTS)
    model_bytes = sum(p.numel() * p.element_size()
                      for p in {id(p): p for p in worker.runner.model.parameters()}.values())
    in_use = weights.bytes_in_use()
    assert in_use >= model_bytes
    llm.engine.shutdown()
    assert weights.bytes_in_use() == in_use - model_bytes
