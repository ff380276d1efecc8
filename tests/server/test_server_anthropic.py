"""The `anthropic` SDK against a real server on a tiny random model."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from conftest import TINY_NAME

from tokenmill import LLM, SamplingParams

MESSAGES = [{"role": "user", "content": "Paris is the capital of"}]
# This SDK version has no sampling arguments; the API's fields still go in the body.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(base_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(str(tiny_model), dtype="float32", block_size=4, num_kv_blocks=4096)


def offline_chat(offline: LLM, conv, max_tokens: int, **kw) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return offline.chat(conv, params, use_tqdm=False)[0].outputs[0].text


def test_message_matches_offline_chat(client, offline):
    m = client.messages.create(model=TINY_NAME, max_tokens=10, extra_body=GREEDY, messages=MESSAGES,
                               metadata={"user_id": "u-1"})
    assert m.type == "message" and m.role == "assistant" and m.model == TINY_NAME
    assert m.content[0].type == "text"
    assert m.content[0].text == offline_chat(offline, MESSAGES, 10)
    assert m.stop_reason in ("max_tokens", "end_turn")
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 10


def test_system_prompt_string_and_blocks(client, offline):
    conv = [{"role": "system", "content": "You are terse."}, *MESSAGES]
    expected = offline_chat(offline, conv, 8)
    as_string = client.messages.create(model=TINY_NAME, max_tokens=8, extra_body=GREEDY,
                                       system="You are terse.", messages=MESSAGES)
    as_blocks = client.messages.create(
        model=TINY_NAME, max_tokens=8, extra_body=GREEDY, messages=MESSAGES,
        system=[{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
    )
    assert as_string.content[0].text == as_blocks.content[0].text == expected
    no_system = client.messages.count_tokens(model=TINY_NAME, messages=MESSAGES).input_tokens
    with_system = client.messages.count_tokens(
        model=TINY_NAME, messages=MESSAGES, system="You are terse."
    ).input_tokens
    assert with_system > no_system


def test_content_blocks_and_multi_turn(client, offline):
    conv = [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": [{"type": "text", "text": "Berlin is"},
                                     {"type": "text", "text": " the capital of"}]},
    ]
    flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "".join(b["text"] for b in m["content"])} for m in conv]
    m = client.messages.create(model=TINY_NAME, max_tokens=6, extra_body=GREEDY, messages=conv)
    assert m.content[0].text == offline_chat(offline, flat, 6)


def test_count_tokens_matches_template(client, offline):
    tok = offline.get_tokenizer()
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    n = client.messages.count_tokens(model=TINY_NAME, messages=MESSAGES).input_tokens
    assert n == len(tok.encode(text, add_special_tokens=False))
    m = client.messages.create(model=TINY_NAME, max_tokens=2, messages=MESSAGES)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n


def test_stream_helper(client):
    kwargs = dict(model=TINY_NAME, max_tokens=12, extra_body=GREEDY, messages=MESSAGES)
    expected = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == expected.content[0].text == final.content[0].text
    assert final.stop_reason == expected.stop_reason
    assert final.usage.output_tokens == expected.usage.output_tokens


def test_stream_event_sequence(base_url):
    body = {"model": TINY_NAME, "max_tokens": 5, "stream": True, "messages": MESSAGES}
    with httpx.stream("POST", f"{base_url}/v1/messages", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line.removeprefix("event: ") for line in r.iter_lines()
                  if line.startswith("event: ")]
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) <= {"content_block_delta"}


def test_stop_sequences(client, offline):
    full = offline_chat(offline, MESSAGES, 16, ignore_eos=True)
    stop = full[4:7]
    assert stop not in full[:6]
    kwargs = dict(model=TINY_NAME, max_tokens=16, extra_body=GREEDY, messages=MESSAGES,
                  stop_sequences=[stop, "never-generated-xyz"])
    m = client.messages.create(**kwargs)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == full[: full.index(stop)]
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == m.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_max_tokens_stop_reason(client):
    m = client.messages.create(model=TINY_NAME, max_tokens=1, messages=MESSAGES,
                               extra_body={"top_k": 5, "top_p": 0.9, "temperature": 0.5})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 1
