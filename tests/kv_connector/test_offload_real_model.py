"""KV offload with the real default model (SmolLM2-135M-Instruct, bf16, the CPU plugin's
kernels): two chat sessions round-robin on a pool smaller than their histories give
the same greedy output as an unlimited pool, and later turns load instead of compute."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TOPICS = ["the history of Rome", "how a compiler works"]


def chat_turns(llm: LLM) -> list[tuple[list[int], int]]:
    """(output ids, prompt tokens computed) per turn, 2 sessions x 2 turns."""
    # long first messages: one session's history fills most of the pool, two do not fit
    ask = "Tell me about {}, in detail. " + "Explain each step carefully and give examples. " * 5
    histories = [[{"role": "user", "content": ask.format(t)}] for t in TOPICS]
    records = []
    for turn in range(2):
        for h in histories:
            (out,) = llm.chat([h], GREEDY, use_tqdm=False)
            records.append((out.outputs[0].token_ids, len(out.prompt_token_ids) - out.num_cached_tokens))
            h += [{"role": "assistant", "content": out.outputs[0].text},
                  {"role": "user", "content": f"Go on (part {turn + 2})."}]
    return records


@pytest.mark.slow
@pytest.mark.long
def test_real_model_sessions_with_a_small_pool_and_offload(tmp_path):
    unlimited = chat_turns(LLM(dtype="bfloat16", num_kv_blocks=256))
    llm = LLM(dtype="bfloat16", num_kv_blocks=8, max_model_len=128,
              kv_offload_host_bytes="2MiB", kv_offload_disk_path=str(tmp_path),
              kv_offload_disk_bytes="64MiB")
    offloaded = chat_turns(llm)
    assert [o for o, _ in offloaded] == [o for o, _ in unlimited]
    stats = llm.engine.offload.stack.stats
    assert stats["host"].tokens_loaded + stats["disk"].tokens_loaded > 0
    assert stats["host"].tokens_recomputed == stats["disk"].tokens_recomputed == 0
