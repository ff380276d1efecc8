"""The tpu plugin's JAX runner serves a hybrid model (Bamba: Mamba2 mixers and full
attention) through the engine, over the worker's KV arena: greedy tokens equal
transformers' with chunked prefill, a prefix-cache hit restores the Mamba2 state from a
checkpoint in the arena and gives the same tokens, and with a device pool that holds one
session and the host (and disk) tiers, agent-like sessions load every previous turn's KV
and state from the tiers instead of computing it again, with the tokens of an unlimited
pool."""

from __future__ import annotations

import random

from tokenmill import LLM, SamplingParams
from tokenmill_tpu.hybrid import TpuBambaRunner

BS = 16  # the platform's one page size
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
NUM_SESSIONS, NUM_TURNS, FIRST, NEW = 3, 3, 40, 6


def _llm(path, **kw) -> LLM:
    # 16-token steps: prompts are prefilled in chunks mixed with other requests' decodes
    return LLM(str(path), platform="tpu", dtype="float32", block_size=BS,
               max_num_batched_tokens=16, **kw)


def _tokens(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def test_bamba_greedy_equals_transformers_and_prefix_hits_restore_state(tiny, hf_greedy):
    llm = _llm(tiny("bamba")[2], num_kv_blocks=256)
    worker = llm.engine.executor.worker
    assert isinstance(worker.runner, TpuBambaRunner) and worker.runner_provider == "tpu"
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 290) for _ in range(n)] for n in (5, 40, 23)]
    got, _ = _tokens(llm, prompts)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy("bamba", prompt, GREEDY.max_tokens), prompt
    again, cached = _tokens(llm, prompts)
    assert again == got
    assert cached[1] >= 2 * BS, "the 40-token prompt should hit two blocks of the cache"
    assert worker.runner.stats.steps > 0


def _replay(llm: LLM) -> list[dict]:
    rng, history, records = random.Random(1), {}, []
    for turn in range(NUM_TURNS):
        for s in range(NUM_SESSIONS):
            user = [rng.randrange(5, 290) for _ in range(FIRST if turn == 0 else NEW)]
            prompt = history.get(s, []) + user
            (tokens,), (cached,) = _tokens(llm, [prompt])
            previous = len(history[s]) - 1 if s in history else 0  # KV the last turn computed
            records.append({"output": tokens, "computed": len(prompt) - cached,
                            "new": len(prompt) - previous})
            history[s] = prompt + tokens
    return records


def test_bamba_sessions_load_kv_and_state_from_the_host_tier(tiny, tmp_path):
    """With a disk tier behind the host: since the offload rework (exclusive placement) a
    finished request's rolling Mamba2 checkpoint is saved only to a durable tier; with the
    host tier alone it is released unsaved and the third turn computes its whole prompt
    again (the core's runner on the cpu platform does the same)."""
    path = tiny("bamba")[2]
    reference = _replay(_llm(path, num_kv_blocks=512))
    llm = _llm(path, num_kv_blocks=24, max_model_len=128, kv_offload_host_bytes="4MiB",
               kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes="16MiB")
    assert llm.engine.executor.worker.runner_caps.kv_offload
    records = _replay(llm)
    assert [r["output"] for r in records] == [r["output"] for r in reference]
    for r in records[NUM_SESSIONS:]:  # later turns: their new tokens (+ a block) only
        assert r["computed"] <= r["new"] + BS, r
    llm.engine.drain_kv_offload()
    stats = llm.engine.offload.snapshot()
    assert stats["host"].tokens_loaded > 0, "the device pool alone could not hold the history"
    assert stats["host"].tokens_recomputed == stats["disk"].tokens_recomputed == 0
