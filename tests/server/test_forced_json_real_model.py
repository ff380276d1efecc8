"""Forced JSON ends, on the default model with no server flags: `tool_choice: "required"`
and a named tool (chat completions and Responses) and Anthropic `output_config.format`
give parseable arguments, finished by the model, not cut at max_tokens, at the model's
default sampling. The schemas are the kind agents send: objects that do not say
`additionalProperties`, strings without `maxLength` (SmolLM2-135M used to add keys, or
newlines, until max_tokens)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from conftest import running_server

from tokenmill import LLM
from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.server.app import build_app

NAME = "smollm2"
pytestmark = pytest.mark.slow

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
          "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                            "parameters": PARAMS}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the weather",
                    "parameters": PARAMS}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = (0,)  # one sample per route: seconds, not minutes (benchmarks/bench_forced_json.py samples 8)


@pytest.fixture(scope="module")
def url():
    llm = LLM(num_kv_blocks=1024)  # the model's own defaults: temperature 0.2, top_p 0.9
    with running_server(build_app(AsyncLLM(engine=llm.engine), [NAME])) as base:
        yield base


@pytest.fixture(scope="module")
def oa(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_chat_forced_call_ends(oa, choice):
    for seed in SEEDS:
        r = oa.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=64, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (seed, c)
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), PARAMS)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
def test_responses_forced_call_ends(oa, choice):
    for seed in SEEDS:
        r = oa.responses.create(model=NAME, input=ASK, tools=RESPONSES_TOOLS, tool_choice=choice,
                                max_output_tokens=64, extra_body={"seed": seed})
        (call,) = [item for item in r.output if item.type == "function_call"]
        assert r.status == "completed", r
        jsonschema.validate(json.loads(call.arguments), PARAMS)


def test_anthropic_output_format_ends(url):
    an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=600)
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "country": {"type": "string"}},
              "required": ["city", "country"]}
    for _ in SEEDS:
        m = an.messages.create(model=NAME, max_tokens=64, messages=[
            {"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
        assert m.stop_reason == "end_turn", m
        jsonschema.validate(json.loads(m.content[0].text), schema)
