"""The engine core in a process of its own (what `tokenmill serve` runs), behind a real
uvicorn on loopback, driven by the real openai and anthropic SDKs: greedy outputs equal the
in-process engine's, n > 1, stop strings, structured output and add errors still work, and
a killed engine process makes /health 503 and fails in-flight and new requests fast."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest
from conftest import TINY_NAME, free_port, running_server, scrape, wait_idle

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineArgs
from tokenmill.frontend.async_engine import AsyncLLM, EngineDeadError
from tokenmill.frontend.output_processor import check_prompt
from tokenmill.server.app import build_app
from tokenmill.structured import StructuredOutputError, StructuredOutputsParams

ENGINE_KW = {"dtype": "float32", "block_size": 4, "max_num_seqs": 16, "num_kv_blocks": 512}
PROMPTS = ["The quick brown fox", "def main():", "Paris is"]


def process_engine(model) -> AsyncLLM:
    return AsyncLLM(EngineArgs(model=str(model), **ENGINE_KW), engine_process=True)


@pytest.fixture(scope="module")
def served(tiny_model):
    engine = process_engine(tiny_model)
    try:
        with running_server(build_app(engine, [TINY_NAME])) as url:
            yield url, engine
    finally:
        engine.shutdown()
    assert not engine._client.proc.is_alive()  # shut down, not left behind


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(str(tiny_model), **ENGINE_KW)


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_the_engine_runs_in_another_process(served):
    _, engine = served
    assert engine.engine is None  # no model in this process
    proc = engine._client.proc
    assert proc.is_alive() and proc.pid != os.getpid()


def test_greedy_completions_equal_in_process(served, offline):
    url, _ = served
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
    client = oai(url)
    for prompt, want in zip(PROMPTS, expected):
        r = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.outputs[0].text
        assert r.usage.completion_tokens == 12
        chunks = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=12,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks) == want.outputs[0].text


def test_greedy_chat_equal_in_process_both_sdks(served, offline):
    url, _ = served
    messages = [{"role": "user", "content": "Say something"}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    r = oai(url).chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want.text
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
    m = client.messages.create(model=TINY_NAME, messages=messages, max_tokens=10,
                               extra_body={"temperature": 0, "ignore_eos": True})
    assert m.content[0].text == want.text and m.usage.output_tokens == 10


def test_n_seeds_logprobs_and_stop_strings(served, offline):
    url, engine = served
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=2)
    want = offline.generate(PROMPTS[0], params, use_tqdm=False)[0]
    r = oai(url).completions.create(model=TINY_NAME, prompt=PROMPTS[0], n=3, seed=7, max_tokens=8,
                                    temperature=1.0, logprobs=2, extra_body={"ignore_eos": True})
    got = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in got] == [o.text for o in want.outputs]
    assert got[0].logprobs.tokens == [o[t].decoded_token for o, t in
                                      zip(want.outputs[0].logprobs, want.outputs[0].token_ids)]
    # a stop string found by the frontend ends the sequence and aborts it in the engine
    greedy = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30,
                                                         ignore_eos=True), use_tqdm=False)
    text = greedy[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    r = oai(url).completions.create(model=TINY_NAME, prompt=PROMPTS[1], max_tokens=30, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    wait_idle(engine)
    assert engine.stats.kv_usage == 0.0
    # the gauges come from the engine process's stats, the counters from the frontend
    metrics = scrape(url)
    assert metrics[("tokenmill:num_requests_running", ())] == 0
    assert metrics[("tokenmill:request_success_total", (("finished_reason", "stop"),))] >= 1


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_structured_output_and_add_errors_are_400s(served):
    url, engine = served
    client = oai(url)
    r = client.chat.completions.create(
        model=TINY_NAME, messages=[{"role": "user", "content": "pick"}], max_tokens=20,
        response_format=_schema({"type": "string", "enum": ["yes", "no"]}),
    )
    assert json.loads(r.choices[0].message.content) in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match="over the context"):
        client.completions.create(model=TINY_NAME, prompt="hi", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=TINY_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=5,
            response_format=_schema({"type": "no-such-type"}),
        )
    assert bad.value.body["param"] == "response_format"
    assert not engine.is_dead


def test_engine_side_add_errors_come_back_per_request(served, monkeypatch):
    """Requests are validated once, at the front (`check_prompt` in AsyncLLM.generate); the
    engine core only compiles a structured output's grammar for its own use. With the
    frontend's compile skipped, a grammar the core cannot compile fails that request
    alone, as the same StructuredOutputError, and the core never checks a prompt again."""
    _, engine = served
    checked = []
    monkeypatch.setattr(
        "tokenmill.frontend.async_engine.check_prompt",
        lambda *args: checked.append(args[0]) or check_prompt(*args),
    )
    monkeypatch.setattr(engine.structured, "compile", lambda params: None)
    ok = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def main():
        running = engine.generate([1, 2, 3], ok, "ok")
        await anext(running)
        with pytest.raises(ValueError, match="over the context"):
            await anext(engine.generate([1, 2, 3], SamplingParams(max_tokens=100_000), "long"))
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
        with pytest.raises(StructuredOutputError):
            await anext(engine.generate([1, 2, 3], bad, "bad-regex"))
        return [out async for out in running][-1]

    last = asyncio.run(asyncio.wait_for(main(), 60))
    assert last.finished and len(last.outputs[0].token_ids) == 20
    assert len(checked) == 3, "each request is checked once, at the front"


def test_killed_engine_process_fails_fast(tiny_model):
    engine = process_engine(tiny_model)
    try:
        with running_server(build_app(engine, [TINY_NAME])) as url, \
                httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            body = {"model": TINY_NAME, "prompt": "hi", "max_tokens": 400, "ignore_eos": True}

            async def in_flight():
                async with httpx.AsyncClient(base_url=url, timeout=30) as ac:
                    async def stream() -> list[str]:
                        async with ac.stream("POST", "/v1/completions",
                                             json={**body, "stream": True}) as r:
                            assert r.status_code == 200
                            lines = []
                            async for line in r.aiter_lines():
                                if line and not lines:
                                    os.kill(engine._client.proc.pid, signal.SIGKILL)
                                if line:
                                    lines.append(line)
                            return lines

                    return await stream(), await ac.post("/v1/completions", json=body)

            t0 = time.monotonic()
            lines, after = asyncio.run(in_flight())
            assert time.monotonic() - t0 < 10  # failed, not hung
            assert lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
            # the cause ("died") is in the log with the request id, never in the answer
            assert error["code"] == 503 and "engine is not running" in error["message"]
            assert "died" not in error["message"] and "request id req_" in error["message"]
            assert after.status_code == 503 and after.json()["error"]["type"] == "server_error"
            assert c.get("/health").status_code == 503
            r = c.post("/v1/messages", json={"model": TINY_NAME, "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
    finally:
        engine.shutdown()
    assert engine.is_dead

    async def new_request():
        await anext(engine.generate([1, 2], SamplingParams(max_tokens=2), "late"))

    with pytest.raises(EngineDeadError):
        asyncio.run(new_request())


def test_a_failed_start_says_why(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="the engine failed to start"):
        AsyncLLM(EngineArgs(model=str(tmp_path), **ENGINE_KW), engine_process=True)


def test_engine_process_exits_when_the_api_server_is_killed(tiny_model):
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.server.cli", "serve", str(tiny_model), "--port",
           str(port), "--dtype", "float32", "--block-size", "4", "--log-level", "warning"]
    api = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert api.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.2)
        engine_pids = [int(p) for p in subprocess.run(
            ["pgrep", "-f", "-P", str(api.pid), "multiprocessing.spawn"],
            capture_output=True, text=True).stdout.split()]
        assert len(engine_pids) == 1
        api.kill()
        api.wait(10)
        deadline = time.monotonic() + 10
        while _alive(engine_pids[0]):
            assert time.monotonic() < deadline, "the engine process outlived its API server"
            time.sleep(0.1)
    finally:
        if api.poll() is None:
            api.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for init to reap it is gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
