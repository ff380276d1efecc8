"""T4 serving smoke: the real tokenmill server on the plugin, through both HTTP APIs.

Starts `tokenmill.server.build_app` under uvicorn on a loopback port with a tiny
model, and checks that OpenAI chat completions and Anthropic messages (plain and
streamed) answer with the same greedy text the reference platform produces offline.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import torch

from tokenmill import SamplingParams
from tokenmill_conformance.session import REFERENCE_NAME
from tokenmill_conformance.tiny_models import make_tiny_model

MODEL_NAME = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Paris is the capital of"}]
MAX_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serve(app) -> Iterator[str]:
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the tokenmill server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _engine_args(active, path) -> dict:
    caps = active.platform.capabilities
    dtype = torch.float32 if torch.float32 in caps.dtypes else active.platform.default_dtype
    return dict(
        model=str(path),
        dtype=str(dtype).removeprefix("torch."),
        block_size=min(caps.block_sizes, key=lambda s: abs(s - 4)),
        num_kv_blocks=256,
    )


@pytest.fixture(scope="module")
def served(conformance, active, tmp_path_factory):
    """(base URL, the reference platform's greedy reply text)."""
    from tokenmill import LLM, AsyncLLM, EngineArgs
    from tokenmill.server import build_app

    path = make_tiny_model(tmp_path_factory.mktemp("serving") / "llama", "llama")
    args = _engine_args(active, path)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = LLM(platform=REFERENCE_NAME, registry=conformance.registry, **args)
    expected = reference.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text
    engine = AsyncLLM(EngineArgs(platform=active.name, **args), registry=conformance.registry)
    with _serve(build_app(engine, [MODEL_NAME])) as url:
        yield url, expected


def _sse(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            events.append(json.loads(line[5:]))
    return events


def test_openai_chat_completions(served):
    url, expected = served
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"]["content"] == expected
    assert data["usage"]["completion_tokens"] == MAX_TOKENS


def test_openai_chat_completions_streamed(served):
    url, expected = served
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        events = _sse(response)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == expected


def test_anthropic_messages(served):
    url, expected = served
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": MAX_TOKENS,
            "temperature": 0}
    response = httpx.post(f"{url}/v1/messages", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["type"] == "message" and data["role"] == "assistant"
    text = "".join(block["text"] for block in data["content"] if block["type"] == "text")
    assert expected.startswith(text) and text, (text, expected)


def test_anthropic_messages_streamed(served):
    url, expected = served
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=120) as response:
        assert response.status_code == 200
        events = _sse(response)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    text = "".join(
        e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta"
    )
    assert expected.startswith(text) and text, (text, expected)
