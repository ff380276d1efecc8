"""Bad input, limits, the API key and a dead engine: right status, right error shape,
never a 5xx for a bad request."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from urllib.parse import urlsplit

import anthropic
import httpx
import openai
import pytest
from conftest import API_KEY, TINY_NAME, running_server, tiny_engine

from tokenmill.server.app import build_app
from tokenmill.server.protocol import MAX_BODY_BYTES

CHAT = [{"role": "user", "content": "hi"}]


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert "type" in err
    return err


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 0}, {"n": 10_000}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5},
        {"max_tokens": 0}, {"presence_penalty": 3}, {"top_logprobs": 100, "logprobs": True},
        {"stop": [""]}, {"seed": -5}, {"messages": []}, {"messages": [{"role": "wizard"}]},
        {"min_tokens": 9, "max_tokens": 3}, {"stop_token_ids": [-1]}, {"top_k": -7},
        {"repetition_penalty": 0}, {"repetition_penalty": 5e-324}, {"top_logprobs": 2},
    ],
)
def test_chat_validation_is_400(http, extra):
    body = {"model": TINY_NAME, "messages": CHAT, "max_tokens": 4, **extra}
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "frequency_penalty", "min_p"])
def test_non_finite_sampling_values_are_400(http, field, value):
    raw = f'{{"model": "{TINY_NAME}", "prompt": "hi", "max_tokens": 2, "{field}": {value}}}'
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize(
    "raw", [b"{not json", b"[]", b'{"prompt": "hi"', b"", b'"just a string"', b"\xff\xfe"]
)
def test_malformed_bodies_are_400(http, raw):
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_completion_prompt_limits(http):
    for prompt in ("", [], [[]], [10**12], ["a"] * 1000):
        r = http.post("/v1/completions", json={"model": TINY_NAME, "prompt": prompt})
        assert_openai_error(r, 400)
    r = http.post("/v1/completions", json={"model": TINY_NAME, "prompt": [299, 10_000]})
    assert "outside the vocabulary" in assert_openai_error(r, 400)["message"]
    r = http.post("/v1/completions", json={"model": TINY_NAME, "prompt": "hi", "logprobs": 21})
    assert_openai_error(r, 400)


def test_over_context_states_both_numbers(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=TINY_NAME, prompt="The quick brown fox", max_tokens=10_000)
    message = e.value.body["message"]
    tokens = httpx.post(f"{base_url}/tokenize", json={"prompt": "The quick brown fox"}).json()
    num_prompt = len(tokens["tokens"])
    assert f"prompt ({num_prompt} tokens)" in message and "max_tokens (10000)" in message
    assert "512" in message  # the context


def test_unknown_model_is_404(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=CHAT)
    aclient = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        aclient.messages.create(model="claude-9", max_tokens=4, messages=CHAT)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_anthropic_errors_have_anthropic_shape(http):
    for body in (
        {"model": TINY_NAME, "messages": CHAT},  # no max_tokens
        {"model": TINY_NAME, "max_tokens": 4, "messages": []},
        {"model": TINY_NAME, "max_tokens": 4, "messages": CHAT, "temperature": 1.5},
        {"model": TINY_NAME, "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
        {"model": TINY_NAME, "max_tokens": 0, "messages": CHAT},
    ):
        assert_anthropic_error(http.post("/v1/messages", json=body), 400, "invalid_request_error")
    r = http.post("/v1/messages/count_tokens", content=b"{", headers={"content-type": "application/json"})
    assert_anthropic_error(r, 400, "invalid_request_error")


def test_anthropic_sdk_raises_bad_request(base_url):
    client = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model=TINY_NAME, max_tokens=8, messages=[{"role": "user", "content": "word " * 600}]
        )


def test_body_and_header_size_limits(http, base_url):
    big = "a " * (MAX_BODY_BYTES // 2 + 10)
    r = http.post("/v1/completions", json={"model": TINY_NAME, "prompt": big})
    assert_openai_error(r, 413)

    def chunks():
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    r = http.post("/v1/messages", content=chunks(), headers={"content-type": "application/json"})
    assert_anthropic_error(r, 413, "request_too_large")
    r = http.get("/v1/models", headers={"x-big": "a" * 20_000})  # over 16 KiB: the app's 431
    assert_openai_error(r, 431)
    # far over: the HTTP parser may refuse it first (a plain 400) when TCP splits the head
    r = http.get("/v1/models", headers={"x-big": "a" * 200_000})
    assert r.status_code in (400, 431)
    assert http.get("/health").status_code == 200


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def test_tokenize_detokenize(http):
    ids = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "The quick brown fox"
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] == 512
    assert_openai_error(http.post("/detokenize", json={"tokens": [10**6]}), 400)
    assert_openai_error(http.post("/tokenize", json={}), 400)
    assert http.get("/version").json()["version"]


# ---- API key ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_url(tiny_model):
    with running_server(build_app(tiny_engine(tiny_model), [TINY_NAME], api_key=API_KEY)) as url:
        yield url


def test_api_key_sdks(keyed_url):
    oai = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=API_KEY, max_retries=0)
    assert oai.completions.create(model=TINY_NAME, prompt="hi", max_tokens=2).choices
    ant = anthropic.Anthropic(base_url=keyed_url, api_key=API_KEY, max_retries=0)  # x-api-key
    assert ant.messages.create(model=TINY_NAME, max_tokens=2, messages=CHAT).content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=keyed_url, api_key="wrong", max_retries=0).messages.create(
            model=TINY_NAME, max_tokens=2, messages=CHAT
        )
    assert e.value.body["error"]["type"] == "authentication_error"


def test_api_key_headers(keyed_url):
    with httpx.Client(base_url=keyed_url) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": API_KEY}).status_code == 401
        assert c.get("/v1/models", headers={"x-api-key": API_KEY + "x"}).status_code == 401
        assert c.get("/v1/models", headers={"x-api-key": "é".encode()}).status_code == 401
        assert c.get("/openapi.json").status_code == 401
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


@pytest.mark.parametrize(
    "path", ["//v1/models", "/v1//models", "/health/../v1/models", "/%761/models", "/V1/models",
             "/health%2F..%2Fv1/models", "/v1/models?x=/health", "/./v1/models"],
)
def test_api_key_checked_on_raw_path(keyed_url, path):
    url = urlsplit(keyed_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        assert r.status == 401, path
    finally:
        conn.close()


# ---- a dead engine ---------------------------------------------------------------------------
def test_engine_crash_fails_requests_and_health(tiny_model):
    engine = tiny_engine(tiny_model, num_kv_blocks=256)
    with running_server(build_app(engine, [TINY_NAME])) as url, httpx.Client(base_url=url) as c:
        assert c.get("/health").status_code == 200
        real_step = engine.engine.core_step
        calls = 0

        def failing_step():
            nonlocal calls
            calls += len(engine.engine.scheduler.requests) >= 2  # once both are in flight
            if calls > 5:
                raise RuntimeError("simulated device failure")
            return real_step()

        engine.engine.core_step = failing_step
        body = {"model": TINY_NAME, "prompt": "hi", "max_tokens": 50, "ignore_eos": True}

        async def in_flight():
            async with httpx.AsyncClient(base_url=url, timeout=30) as ac:
                async def stream() -> list[str]:
                    async with ac.stream("POST", "/v1/completions",
                                         json={**body, "stream": True}) as r:
                        assert r.status_code == 200
                        return [line async for line in r.aiter_lines() if line]

                return await asyncio.gather(ac.post("/v1/completions", json=body), stream())

        t0 = time.monotonic()
        plain, lines = asyncio.run(in_flight())
        assert time.monotonic() - t0 < 10  # failed, not hung
        assert plain.status_code == 503
        message = plain.json()["error"]["message"]
        assert "simulated device failure" not in message  # internal text: the log only
        assert f"request id {plain.headers['x-request-id']}" in message
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "engine is not running" in error["message"]
        assert "simulated device failure" not in error["message"]
        assert c.get("/health").status_code == 503
        assert c.post("/v1/completions", json=body, timeout=30).status_code == 503
        r = c.post("/v1/messages", timeout=30,
                   json={"model": TINY_NAME, "max_tokens": 4, "messages": CHAT})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
