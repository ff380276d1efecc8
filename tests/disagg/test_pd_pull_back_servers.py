"""An agent's next turn through real processes (1P1D on loopback, no shared tier): the
router names the decode instance that answered turn N, the prefill instance of turn N+1
asks it to lease the longest prefix of the new prompt it holds (turn N's prompt and
output), pulls what it lacks and computes only the rest. Greedy output equals a colocated
conversation's; each next turn computes at most its new tokens + the last sampled token
+ one block on the prefill instance; every lease goes back."""

from __future__ import annotations

import time

import openai
import pytest
from pd_cluster import BLOCK_SIZE, cluster, metric

from tokenmill import LLM, SamplingParams
from tokenmill_conformance.tiny_models import make_tiny_model

pytestmark = pytest.mark.long  # three server processes: minutes

MAX_NEW = 8
# a chat conversation: the router keys it by its system prompt and first message
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
USERS = ["Plan a trip to the mountains with three stops and a budget.", "Shorter, please.",
         "Now add one more stop."]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _colocated(model) -> tuple[list[str], list[int]]:
    """The colocated conversation's replies, and each turn's new tokens: those its prompt
    does not share with the last turn's prompt + output."""
    llm = LLM(str(model), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=512)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    texts, new, messages, seen = [], [], [SYSTEM], []
    for user in USERS:
        messages.append({"role": "user", "content": user})
        out = llm.chat(messages, greedy, use_tqdm=False)[0]
        new.append(len(out.prompt_token_ids) - _common(out.prompt_token_ids, seen))
        seen = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        texts.append(out.outputs[0].text)
        messages.append({"role": "assistant", "content": texts[-1]})
    llm.engine.shutdown()
    return texts, new


def test_next_turn_pulls_back_through_the_router(tmp_path):
    # llama: a hybrid model's decode instance keeps recurrent checkpoints only where its
    # sequences' blocks ended, which a chat turn's retemplated text does not reach (the
    # token-level hybrid case: test_pd_pull_back.py, qwen3_next)
    model = make_tiny_model(tmp_path / "model", "llama")
    texts, new = _colocated(model)
    with cluster(model, tmp_path) as (front, (prefill,), (decode,)):
        client = openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0)
        messages = [SYSTEM]
        for i, user in enumerate(USERS):
            messages.append({"role": "user", "content": user})
            queried = metric(prefill.url, "tokenmill:prefix_cache_queries_total")
            hits = metric(prefill.url, "tokenmill:prefix_cache_hits_total")
            out = client.chat.completions.create(model="tiny", messages=messages,
                                                 max_tokens=MAX_NEW, temperature=0,
                                                 extra_body={"ignore_eos": True})
            assert out.choices[0].message.content == texts[i]
            computed = (metric(prefill.url, "tokenmill:prefix_cache_queries_total") - queried) - (
                metric(prefill.url, "tokenmill:prefix_cache_hits_total") - hits)
            if i:  # the new tokens, the last sampled one (never fed) and one block at most
                assert computed <= new[i] + 1 + BLOCK_SIZE, (i, computed, new[i])
            messages.append({"role": "assistant", "content": texts[i]})
        # both next turns pulled turn N back from the decode instance
        assert metric(prefill.url, "tokenmill:kv_handover_received_total") == 2
        assert metric(decode.url, "tokenmill:kv_handover_offered_total") == 2
        deadline = time.monotonic() + 10  # releases are sent in the background
        while metric(decode.url, "tokenmill:kv_handover_leases_held") and (
                time.monotonic() < deadline):
            time.sleep(0.2)
        assert metric(decode.url, "tokenmill:kv_handover_leases_held") == 0
