"""Chat templates under limits, through a real server and the `openai` SDK: a request's own
template is refused unless the server trusts them; every render has a time limit and a
size limit; rendering runs on a bounded pool of its own, so a flood of slow renders gets
429s with Retry-After and never starves `/health`."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from conftest import TINY_NAME, running_server, tiny_engine

from tokenmill.server.app import build_app
from tokenmill.server.render import RenderPool

CHAT = [{"role": "user", "content": "hi"}]
# 10^10 empty iterations: never ends without the time limit (the sandbox caps each range)
ENDLESS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{{ messages[0]['content'] }}")
# two million copies of the message: megabytes of prompt, quickly
HUGE = "{% for i in range(1000) %}{{ messages[0]['content'] * 2000 }}{% endfor %}"
TIME_LIMIT_S = 1.0


@pytest.fixture(scope="module")
def trusting(tiny_model):
    engine = tiny_engine(tiny_model, num_kv_blocks=256)
    pool = RenderPool(workers=1, max_pending=3, time_limit_s=TIME_LIMIT_S)
    app = build_app(engine, [TINY_NAME], trust_request_chat_template=True, render_pool=pool)
    with running_server(app) as url:
        yield url


def _chat(url: str, template: str, **kw) -> httpx.Response:
    body = {"model": TINY_NAME, "messages": CHAT, "max_tokens": 2, "chat_template": template, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_request_template_refused_unless_trusted(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="trust-request-chat-template") as e:
        client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=2,
                                       extra_body={"chat_template": "{{ 'x' }}"})
    assert e.value.body["param"] == "chat_template"


@pytest.mark.parametrize(
    ("template", "needle"),
    [("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
     ("{% for m in %}", "chat template failed")],
)
def test_chat_template_failure_is_400(trusting, template, needle):
    r = _chat(trusting, template)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_trusted_request_template_is_used(trusting):
    client = openai.OpenAI(base_url=f"{trusting}/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=2,
                                       extra_body={"chat_template": "Q: {{ messages[0]['content'] }}\nA:"})
    assert r.usage.prompt_tokens == len(httpx.post(f"{trusting}/tokenize", json={
        "model": TINY_NAME, "prompt": "Q: hi\nA:", "add_special_tokens": False}).json()["tokens"])


def test_endless_template_stops_at_the_time_limit_and_health_answers(trusting):
    async def main():
        async with httpx.AsyncClient(base_url=trusting, timeout=60) as c:
            body = {"model": TINY_NAME, "messages": CHAT, "max_tokens": 2, "chat_template": ENDLESS}
            t0 = time.monotonic()
            slow = asyncio.create_task(c.post("/v1/chat/completions", json=body))
            health = []
            while not slow.done():
                h0 = time.monotonic()
                assert (await c.get("/health")).status_code == 200
                health.append(time.monotonic() - h0)
                await asyncio.sleep(0.05)
            return await slow, time.monotonic() - t0, health

    r, elapsed, health = asyncio.run(main())
    assert r.status_code == 400, r.text
    assert "took longer than 1 s" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "chat_template"
    assert TIME_LIMIT_S <= elapsed < TIME_LIMIT_S + 10
    assert len(health) >= 3 and max(health) < 1.0, health
    assert _chat(trusting, "{{ messages[0]['content'] }}").status_code == 200  # the pool recovered


def test_huge_prompt_is_refused_by_size(trusting):
    r = _chat(trusting, HUGE)
    assert r.status_code == 400
    assert "characters, over the limit" in r.json()["error"]["message"]


def test_full_render_pool_answers_429_and_health_still_answers(trusting):
    async def main():
        async with httpx.AsyncClient(base_url=trusting, timeout=60) as c:
            body = {"model": TINY_NAME, "messages": CHAT, "max_tokens": 2, "chat_template": ENDLESS}
            flood = [asyncio.create_task(c.post("/v1/chat/completions", json=body))
                     for _ in range(8)]
            health = []
            while not all(f.done() for f in flood):
                h0 = time.monotonic()
                assert (await c.get("/health")).status_code == 200
                health.append(time.monotonic() - h0)
                await asyncio.sleep(0.05)
            return await asyncio.gather(*flood), health

    answers, health = asyncio.run(main())
    # one worker, three admitted (each stopped at the time limit), the rest refused at once
    assert sorted(r.status_code for r in answers) == [400] * 3 + [429] * 5
    busy = [r for r in answers if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" for r in busy)
    assert busy[0].json()["error"]["code"] == "rate_limit_exceeded"
    assert len(health) >= 5 and sorted(health)[len(health) // 2] < 0.25, health
