"""Tools and JSON output with the real default model (SmolLM2-135M-Instruct) through the
`openai` and `anthropic` SDKs: forced tool calls (named, required / any, tool) parse and
validate against their schema, streamed and not; a three-turn agent loop per SDK reuses
the previous turns' KV (cached prompt tokens in usage); response_format gives valid JSON;
a bad schema is a 400 for that request only. Constrained decoding is the core's
(`tokenmill.StructuredOutputsParams`)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import running_server

from tokenmill import LLM
from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.server.app import build_app

NAME = "smollm2"
pytestmark = pytest.mark.slow

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 40}},
    "required": ["timezone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
     "Get the current weather in a city", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description":
     "Get the current time in a time zone", "parameters": TIME_PARAMS}},
]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in OPENAI_TOOLS]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
GREEDY = {"temperature": 0}


def run_tool(name: str, args: dict) -> str:
    if name == "get_weather":
        return json.dumps({"city": args["city"], "temperature": 22, "unit": args["unit"],
                           "sky": "sunny"})
    return json.dumps({"timezone": args["timezone"], "time": "14:05"})


@pytest.fixture(scope="module")
def url():
    llm = LLM(dtype="float32", num_kv_blocks=1024)
    app = build_app(AsyncLLM(engine=llm.engine), [NAME], enable_auto_tool_choice=True,
                    tool_call_parser="hermes")
    with running_server(app) as base:
        yield base


@pytest.fixture(scope="module")
def oa(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def an(url):
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=300)


def _valid(name: str, args: dict) -> None:
    jsonschema.validate(args, SCHEMAS[name])


OPENAI_CHOICES = ["required", {"type": "function", "function": {"name": "get_weather"}},
                  {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize("choice", OPENAI_CHOICES, ids=["required", "get_weather", "get_time"])
def test_openai_forced_call_validates(oa, choice):
    r = oa.chat.completions.create(model=NAME, messages=ASK, tools=OPENAI_TOOLS,
                                   tool_choice=choice, max_tokens=120, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == choice["function"]["name"]
    _valid(call.function.name, json.loads(call.function.arguments))
    chunks = list(oa.chat.completions.create(
        model=NAME, messages=ASK, tools=OPENAI_TOOLS, tool_choice=choice, max_tokens=120,
        temperature=0, stream=True))
    names, args = [], ""
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            assert d.index == 0
            if d.function.name:
                names.append(d.function.name)
            args += d.function.arguments or ""
    assert names == [call.function.name] and json.loads(args) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"},
                                    {"type": "tool", "name": "get_time"}],
                         ids=["any", "get_weather", "get_time"])
def test_anthropic_forced_tool_use_validates(an, choice):
    m = an.messages.create(model=NAME, max_tokens=120, messages=ASK, tools=ANTHROPIC_TOOLS,
                           tool_choice=choice, extra_body=GREEDY)
    assert m.stop_reason == "tool_use", m
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_")
    if choice["type"] == "tool":
        assert use.name == choice["name"]
    _valid(use.name, use.input)
    with an.messages.stream(model=NAME, max_tokens=120, messages=ASK, tools=ANTHROPIC_TOOLS,
                            tool_choice=choice, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (use.name, use.input)
    assert final.stop_reason == "tool_use"


def test_openai_agent_loop_reuses_kv(oa):
    """Call a tool, get its result, call another, get its result, answer."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}, *ASK]
    cached = []
    for turn, choice in enumerate(["required", {"type": "function", "function": {"name": "get_time"}},
                                   "none"]):
        r = oa.chat.completions.create(model=NAME, messages=messages, tools=OPENAI_TOOLS,
                                       tool_choice=choice, max_tokens=120, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        msg = r.choices[0].message
        if turn < 2:
            (call,) = msg.tool_calls
            args = json.loads(call.function.arguments)
            _valid(call.function.name, args)
            messages.append(msg.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, args)})
        else:
            assert not msg.tool_calls and msg.content
    assert cached[1] > 0 and cached[2] > cached[1], cached


def test_anthropic_agent_loop_reuses_kv(an):
    messages = list(ASK)
    cached = []
    for turn, choice in enumerate([{"type": "any"}, {"type": "tool", "name": "get_time"},
                                   {"type": "none"}]):
        m = an.messages.create(model=NAME, max_tokens=120, messages=messages,
                               system="You are a helpful assistant.", tools=ANTHROPIC_TOOLS,
                               tool_choice=choice, extra_body=GREEDY)
        cached.append(m.usage.cache_read_input_tokens)
        if turn < 2:
            (use,) = [b for b in m.content if b.type == "tool_use"]
            _valid(use.name, use.input)
            messages.append({"role": "assistant", "content": [b.model_dump() for b in m.content]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": run_tool(use.name, use.input)}]})
        else:
            assert m.stop_reason in ("end_turn", "max_tokens")
            assert m.content[0].type == "text" and m.content[0].text
    assert cached[1] > 0 and cached[2] > cached[1], cached


def test_response_format_json(oa):
    # json_object bounds nothing but the syntax: a prompt the 135M model answers briefly
    r = oa.chat.completions.create(
        model=NAME, max_tokens=100, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Return a JSON object with the key "capital" for France.'}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40},
                      "maxItems": 3}},
        "required": ["name", "population", "landmarks"], "additionalProperties": False}
    for strict in (True, False):
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema,
                                                      "strict": strict}}
        r = oa.chat.completions.create(
            model=NAME, max_tokens=150, temperature=0, response_format=fmt,
            messages=[{"role": "user", "content": "Give facts about Paris."}])
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    stream = oa.chat.completions.create(
        model=NAME, max_tokens=150, temperature=0, response_format=fmt, stream=True,
        messages=[{"role": "user", "content": "Give facts about Paris."}])
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream)), schema)


BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}


def test_bad_schema_is_400_for_that_request_only(url, oa, an):
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": BAD_SCHEMA}}
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": NAME, "messages": ASK, "max_tokens": 5, "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "response_format"
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": NAME, "messages": ASK, "max_tokens": 5, "tools": bad_tool,
        "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = httpx.post(f"{url}/v1/messages", timeout=120, json={
        "model": NAME, "messages": ASK, "max_tokens": 5, "tool_choice": {"type": "any"},
        "tools": [{"name": "f", "input_schema": BAD_SCHEMA}]})
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": r.json()["error"]["message"]}}
    # the server is unharmed
    ok = oa.chat.completions.create(model=NAME, messages=ASK, max_tokens=3)
    assert ok.choices[0].message.content
