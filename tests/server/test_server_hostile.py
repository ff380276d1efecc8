"""What a hostile or careless client sends, through a real server and the real SDKs: lone
surrogates, deep nesting, overlong free strings (400, never 500); a full waiting queue
(429 with Retry-After, in each API's error shape); request ids on every answer."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest
from conftest import TINY_NAME, running_server, scrape, tiny_engine

from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.frontend.outputs import CompletionOutput, RequestOutput
from tokenmill.server.app import build_app

CHAT = [{"role": "user", "content": "hi"}]


def _deep(levels: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(levels):
        value = {"a": value}
    return value


@pytest.fixture(scope="module")
def clients(base_url):
    return (openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0),
            anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0))


# The Python SDKs refuse to encode a lone surrogate; JavaScript's JSON.stringify writes one
# as a `\udce9` escape, so these bodies are the raw JSON such a client sends.
SURROGATE_BODIES = [
    ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", '
     '"content": "caf\\udce9"}]}', "messages.0.content"),
    ("/v1/completions", '{"model": "%s", "max_tokens": 2, "prompt": "caf\\udce9"}', "prompt"),
    ("/v1/responses", '{"model": "%s", "max_output_tokens": 2, "input": "\\ud83d"}', "input"),
    ("/v1/messages", '{"model": "%s", "max_tokens": 2, "system": "\\udc00x", "messages": '
     '[{"role": "user", "content": "hi"}]}', "system"),
    ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", '
     '"content": "hi"}], "chat_template_kwargs": {"\\ud800": 1}}', "chat_template_kwargs"),
]


@pytest.mark.parametrize(("path", "body", "where"), SURROGATE_BODIES)
def test_lone_surrogates_are_400(base_url, path, body, where):
    r = httpx.post(f"{base_url}{path}", content=(body % TINY_NAME).encode(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    body = r.json()
    error = body["error"]
    assert "lone UTF-16 surrogate" in error["message"] and where in error["message"]
    if path == "/v1/messages":
        assert body["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["type"] == "invalid_request_error"
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=30, json={  # a real pair is fine
        "model": TINY_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "ok 🙂"}]})
    assert r.status_code == 200


def test_deep_nesting_is_400(clients):
    oa, an = clients
    with pytest.raises(openai.BadRequestError, match="nested deeper than 64"):
        oa.chat.completions.create(model=TINY_NAME, max_tokens=2, messages=CHAT,
                                   extra_body={"chat_template_kwargs": _deep(200)})
    with pytest.raises(anthropic.BadRequestError, match="nested deeper than 64"):
        an.messages.create(model=TINY_NAME, max_tokens=2, messages=CHAT, tool_choice={"type": "any"},
                           tools=[{"name": "f", "input_schema": _deep(100)}])
    oa.chat.completions.create(model=TINY_NAME, max_tokens=2, messages=CHAT,  # shallow is fine
                               extra_body={"chat_template_kwargs": _deep(20)})


def test_overlong_free_strings_are_400(clients, base_url):
    oa, an = clients
    with pytest.raises(openai.BadRequestError, match="user"):
        oa.chat.completions.create(model=TINY_NAME, max_tokens=2, messages=CHAT, user="u" * 513)
    with pytest.raises(anthropic.BadRequestError, match="metadata.user_id"):
        an.messages.create(model=TINY_NAME, max_tokens=2, messages=CHAT,
                           metadata={"user_id": "u" * 257})
    with pytest.raises(openai.BadRequestError, match="metadata"):
        oa.responses.create(model=TINY_NAME, input="hi", max_output_tokens=2,
                            metadata={"k": "v" * 513})
    with pytest.raises(openai.BadRequestError, match="metadata"):
        oa.responses.create(model=TINY_NAME, input="hi", max_output_tokens=2,
                            metadata={"k" * 65: "v"})
    with pytest.raises(openai.BadRequestError, match="model"):
        oa.chat.completions.create(model="m" * 300, max_tokens=2, messages=CHAT)
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=30, json={
        "model": TINY_NAME, "max_tokens": 2, "messages": [{**CHAT[0], "name": "n" * 300}]})
    assert r.status_code == 400


def test_every_answer_carries_a_request_id(base_url):
    ok = httpx.get(f"{base_url}/v1/models")
    bad = httpx.post(f"{base_url}/v1/messages", json={})
    assert ok.headers["x-request-id"].startswith("req_")
    assert bad.headers["request-id"] == bad.headers["x-request-id"] != ok.headers["x-request-id"]
    mine = httpx.get(f"{base_url}/health", headers={"x-request-id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    odd = httpx.get(f"{base_url}/health", headers={"x-request-id": "a b\tc"})
    assert odd.headers["x-request-id"].startswith("req_")  # not echoed as given


# allOf over anyOfs multiplies out: 6 x 6 alternatives, past llguidance's schema-size limit
OVER_LIMITS = {"allOf": [{"anyOf": [{"type": "object", "properties": {f"p{i}_{j}": {"type": "integer"}}}
                                    for j in range(6)]} for i in range(6)]}


def _finished(base_url: str) -> float:
    return sum(v for (name, _), v in scrape(base_url).items()
               if name == "tokenmill:request_success_total")


def test_grammar_over_llguidances_limits_is_400_before_admission(clients, base_url):
    oa, an = clients
    before = _finished(base_url)
    with pytest.raises(openai.BadRequestError, match="schema too large"):
        oa.chat.completions.create(model=TINY_NAME, max_tokens=4, messages=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "big", "schema": OVER_LIMITS}})
    with pytest.raises(anthropic.BadRequestError, match="schema too large"):
        an.messages.create(model=TINY_NAME, max_tokens=4, messages=CHAT, extra_body={
            "output_config": {"format": {"type": "json_schema", "schema": OVER_LIMITS}}})
    assert _finished(base_url) == before  # refused in the API process: the engine never ran it


@pytest.fixture(scope="module")
def one_slot(tiny_model):
    """One sequence runs, none may wait: a second request while one runs is a 429."""
    engine = tiny_engine(tiny_model, max_num_seqs=1, num_kv_blocks=256)
    with running_server(build_app(engine, [TINY_NAME], max_waiting_requests=0)) as url:
        yield url


def _free_again(oa: openai.OpenAI, timeout_s: float):
    """The first chat completion the server admits within `timeout_s` (a 429 till then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return oa.chat.completions.create(model=TINY_NAME, max_tokens=2, messages=CHAT)
        except openai.RateLimitError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_full_queue_is_429_with_retry_after_in_each_shape(one_slot):
    oa = openai.OpenAI(base_url=f"{one_slot}/v1", api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=one_slot, api_key="x", max_retries=0)
    with oa.completions.create(model=TINY_NAME, prompt="hold", max_tokens=400,
                               stream=True, extra_body={"ignore_eos": True}) as held:
        next(iter(held))  # running now
        with pytest.raises(openai.RateLimitError) as chat:
            oa.chat.completions.create(model=TINY_NAME, max_tokens=2, messages=CHAT)
        with pytest.raises(openai.RateLimitError) as responses:
            oa.responses.create(model=TINY_NAME, input="hi", max_output_tokens=2)
        with pytest.raises(anthropic.RateLimitError) as messages:
            an.messages.create(model=TINY_NAME, max_tokens=2, messages=CHAT)
        # refused before rendering: a prompt over the render size limit (a 400 once
        # rendered) is a 429 here, so a burst's refusals cost no render work
        with pytest.raises(openai.RateLimitError):
            oa.chat.completions.create(model=TINY_NAME, max_tokens=2, messages=[
                {"role": "user", "content": "a " * 1_500_000}])
    for e in (chat, responses, messages):
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert "--max-waiting-requests" in e.value.message
    assert chat.value.body["code"] == "rate_limit_exceeded"
    assert messages.value.body["type"] == "error"
    assert messages.value.body["error"]["type"] == "rate_limit_error"
    # once the held request is gone, the slot is free again: the server learns of the
    # closed stream on its next send, after the client's close returned, so it may take
    # a moment (CI's run once came back here before the release)
    assert _free_again(oa, timeout_s=10.0).choices
    with pytest.raises(openai.BadRequestError, match="over the limit"):  # rendered: too big
        oa.chat.completions.create(model=TINY_NAME, max_tokens=2, messages=[
            {"role": "user", "content": "a " * 1_500_000}])


class ConstraintFailsLLM(AsyncLLM):
    """An engine whose every request ends as the core ends one whose grammar ran past
    llguidance's limits mid-generation (finish_reason "error", the core's stop_reason)."""

    async def generate(self, prompt_token_ids, params, request_id, prompt=None, cache_salt=None,
                       session_id=None):
        yield RequestOutput(request_id, prompt, prompt_token_ids,
                            [CompletionOutput(0, '{"a"', [5])], finished=False)
        failed = CompletionOutput(0, '{"a"', [5, 6], finish_reason="error",
                                  stop_reason="structured output: step fuel exhausted")
        yield RequestOutput(request_id, prompt, prompt_token_ids, [failed], finished=True)


def test_constraint_failing_mid_generation_is_400_not_500(tiny_model):
    engine = ConstraintFailsLLM(engine=tiny_engine(tiny_model, num_kv_blocks=64).engine)
    with running_server(build_app(engine, [TINY_NAME])) as url:
        body = {"model": TINY_NAME, "max_tokens": 8, "messages": CHAT,
                "response_format": {"type": "json_object"}}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and "step fuel exhausted" in r.json()["error"]["message"]
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=30) as s:
            data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        error = json.loads(data[-2])["error"]
        assert error["code"] == 400 and error["type"] == "invalid_request_error"
