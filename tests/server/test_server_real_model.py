"""The real default model (SmolLM2-135M-Instruct) behind the server: greedy answers through
the `openai` and `anthropic` SDKs are identical to the offline `LLM`'s."""

from __future__ import annotations

import anthropic
import openai
import pytest
from conftest import running_server

from tokenmill import LLM, SamplingParams
from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.server.app import build_app

NAME = "smollm2"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served():
    """Offline references first, then the same engine behind a server (one model load).

    Prefix caching is off so the server's run recomputes every token, as the offline did.
    """
    llm = LLM(dtype="float32", num_kv_blocks=512, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    refs = {
        "generate": [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)],
        "chat": llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0],
    }
    with running_server(build_app(AsyncLLM(engine=llm.engine), [NAME])) as url:
        yield url, refs


def test_openai_greedy_identical_to_offline(served):
    url, refs = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == refs["generate"]
    expected = refs["chat"].outputs[0]
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=32, temperature=0)
    assert r.choices[0].message.content == expected.text
    assert "Paris" in expected.text
    assert r.choices[0].finish_reason == expected.finish_reason == "stop"
    stream = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=32,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text


def test_anthropic_end_turn(served):
    url, refs = served
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    m = client.messages.create(model=NAME, max_tokens=32, messages=CHAT,
                               extra_body={"temperature": 0})
    assert m.content[0].text == refs["chat"].outputs[0].text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
