"""Tools through the real `openai` and `anthropic` SDKs against a real server whose engine
answers with scripted text (a random tiny model never writes a tool call): request
mapping, tool-call shaping streamed and not, tool turns in the prompt, and the 400s."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from conftest import running_server, tiny_engine

from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.frontend.outputs import CompletionOutput, RequestOutput
from tokenmill.server.app import build_app

NAME = "scripted"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Current weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedLLM(AsyncLLM):
    """The tiny model's engine (tokenizer, template, lifecycle), answering `script` in
    3-character steps, and keeping the last prompt and params it was given."""

    script = "Hello."
    prompt: str | None = None
    params = None

    hinted: list[str] = []  # sessions the server said will return (a turn ended in a tool call)

    def hint_session(self, session_id: str) -> None:
        self.hinted.append(session_id)

    async def generate(self, prompt_token_ids, params, request_id, prompt=None, cache_salt=None,
                       session_id=None):
        self.prompt, self.params = prompt, params
        text, n = self.script, len(self.script)
        for end in [*range(3, n, 3), n]:
            done = end == n
            out = CompletionOutput(0, text[:end], list(range(1, end // 3 + 2)),
                                   finish_reason="stop" if done else None)
            yield RequestOutput(request_id, prompt, prompt_token_ids, [out], finished=done)


@pytest.fixture(scope="module")
def scripted(tiny_model):
    real = tiny_engine(tiny_model)
    engine = ScriptedLLM(engine=real.engine)
    app = build_app(engine, [NAME], enable_auto_tool_choice=True, tool_call_parser="hermes",
                    trust_request_chat_template=True)
    with running_server(app) as url:
        yield url, engine


@pytest.fixture(scope="module")
def no_auto(tiny_model):
    engine = tiny_engine(tiny_model)
    with running_server(build_app(engine, [NAME], enable_auto_tool_choice=False)) as url:
        yield url


@pytest.fixture()
def oa(scripted):
    return openai.OpenAI(base_url=f"{scripted[0]}/v1", api_key="x", max_retries=0)


@pytest.fixture()
def an(scripted):
    return anthropic.Anthropic(base_url=scripted[0], api_key="x", max_retries=0)


def say(scripted, text: str) -> ScriptedLLM:
    scripted[1].script = text
    return scripted[1]


# ---- OpenAI ------------------------------------------------------------------------------
def test_openai_auto_tool_call(scripted, oa):
    engine = say(scripted, "Let me check. " + CALL)
    r = oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, CLOCK])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the template knows no tools, so they were described in the system message
    assert "<tools>" in engine.prompt and '"name": "get_time"' in engine.prompt


def test_openai_auto_stream_matches(scripted, oa):
    say(scripted, "Let me check. " + CALL + CALL.replace("Paris", "Lyon"))
    chunks = list(oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                             stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "args": ""})
            entry["args"] += d.function.arguments or ""
    assert content == "Let me check. "
    assert [(v["name"], json.loads(v["args"])) for _, v in sorted(calls.items())] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    assert all(v["id"].startswith("call_") for v in calls.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_openai_stream_helper_accumulates(scripted, oa):
    say(scripted, CALL)
    with oa.chat.completions.stream(model=NAME, messages=ASK, tools=[WEATHER]) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert final.choices[0].finish_reason == "tool_calls"


def test_openai_malformed_call_is_content(scripted, oa):
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    say(scripted, bad)
    r = oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER])
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    chunks = list(oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == bad


def test_openai_tool_choice_none_is_not_parsed(scripted, oa):
    engine = say(scripted, CALL)
    r = oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == CALL and r.choices[0].finish_reason == "stop"
    assert "<tools>" in engine.prompt  # still offered: the prompt prefix stays the same


def test_openai_parallel_tool_calls_false_keeps_one(scripted, oa):
    say(scripted, CALL + CALL.replace("Paris", "Lyon"))
    r = oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                   parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1


def test_openai_tool_turns_reach_the_prompt(scripted, oa):
    engine = say(scripted, "It is sunny in Paris.")
    conv = [*ASK,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22C, sunny"}]
    r = oa.chat.completions.create(model=NAME, messages=conv, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in engine.prompt
    assert "<tool_response>\n22C, sunny\n</tool_response>" in engine.prompt


TOOL_TEMPLATE = (  # a template that reads tools itself
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
    "{% endfor %}\n{% endfor %}assistant:"
)


def test_openai_template_that_reads_tools_gets_them(scripted, oa):
    engine = say(scripted, "ok")
    conv = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
    oa.chat.completions.create(model=NAME, messages=conv, tools=[WEATHER, CLOCK], tool_choice="none",
                               extra_body={"chat_template": TOOL_TEMPLATE})
    assert engine.prompt.startswith("TOOLS:get_weather;get_time;")
    assert "CALL get_weather Oslo" in engine.prompt and "tool: cold" in engine.prompt
    assert "<tools>" not in engine.prompt


def test_openai_tool_errors(scripted, no_auto):
    url = scripted[0]
    base = {"model": NAME, "messages": ASK, "tools": [WEATHER]}
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
          "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ]
    for extra, param in cases:
        r = httpx.post(f"{url}/v1/chat/completions", json={**base, **extra}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (extra, err)
    # auto (the default with tools) is refused where the server turned it off
    client = openai.OpenAI(base_url=f"{no_auto}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no-enable-auto-tool-choice"):
        client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER])


# ---- Anthropic ---------------------------------------------------------------------------
def test_anthropic_auto_tool_use(scripted, an):
    say(scripted, "Checking. " + CALL)
    m = an.messages.create(model=NAME, max_tokens=64, messages=ASK, tools=[ANTHROPIC_WEATHER])
    assert m.stop_reason == "tool_use"
    text, use = m.content
    assert text.type == "text" and text.text == "Checking. "
    assert use.type == "tool_use" and use.id.startswith("toolu_")
    assert use.name == "get_weather" and use.input == {"city": "Paris"}


def test_anthropic_stream_helper_accumulates_input(scripted, an):
    say(scripted, "Checking. " + CALL)
    with an.messages.stream(model=NAME, max_tokens=64, messages=ASK,
                            tools=[ANTHROPIC_WEATHER]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and "content_block_stop" in kinds
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Checking. "
    assert final.content[1].input == {"city": "Paris"}


def test_anthropic_raw_stream_events(scripted):
    say(scripted, CALL)
    body = {"model": NAME, "max_tokens": 64, "messages": ASK, "tools": [ANTHROPIC_WEATHER],
            "stream": True}
    with httpx.stream("POST", f"{scripted[0]}/v1/messages", json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["index"] == 0 and start["content_block"]["type"] == "tool_use"
    assert start["content_block"]["input"] == {}
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"}
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use"


def test_anthropic_tool_result_turns(scripted, an):
    engine = say(scripted, "Sunny.")
    conv = [*ASK,
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "22C"}]},
                {"type": "text", "text": "And tomorrow?"}]}]
    m = an.messages.create(model=NAME, max_tokens=32, messages=conv, tools=[ANTHROPIC_WEATHER],
                           tool_choice={"type": "none"})
    assert m.content[0].text == "Sunny." and m.stop_reason == "end_turn"
    p = engine.prompt
    assert p.index("Checking.\n<tool_call>") < p.index("<tool_response>\n22C\n</tool_response>")
    assert p.index("</tool_response>") < p.index("And tomorrow?")
    n = an.messages.count_tokens(model=NAME, messages=conv, tools=[ANTHROPIC_WEATHER])
    assert n.input_tokens == len(engine.tokenizer.encode(p, add_special_tokens=False))


def test_anthropic_tool_errors(scripted, no_auto):
    base = {"model": NAME, "max_tokens": 8, "messages": ASK, "tools": [ANTHROPIC_WEATHER]}
    for extra in ({"tool_choice": {"type": "tool", "name": "nope"}},
                  {"tool_choice": {"type": "any"}, "tools": None},
                  {"tool_choice": {"type": "sometimes"}},
                  {"tools": [{"name": "x"}]}):
        r = httpx.post(f"{scripted[0]}/v1/messages", json={**base, **extra}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
    client = anthropic.Anthropic(base_url=no_auto, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="no-enable-auto-tool-choice"):
        client.messages.create(model=NAME, max_tokens=8, messages=ASK, tools=[ANTHROPIC_WEATHER])


# ---- forced calls (the output is constrained by the core; here it is scripted) -------------
def test_openai_named_call_streams_arguments_live(scripted, oa):
    engine = say(scripted, '{"city": "Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, CLOCK],
                                   tool_choice=named)
    # the tool's parameters, closed (no keys but its own: forced JSON ends)
    assert engine.params.structured_outputs.json == {**WEATHER["function"]["parameters"],
                                                     "additionalProperties": False}
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    chunks = list(oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                             tool_choice=named, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert len(deltas) > 3  # the arguments came in pieces as they were generated
    assert "".join(d.function.arguments or "" for d in deltas) == '{"city": "Paris"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_openai_required_call(scripted, oa):
    engine = say(scripted, '{"name": "get_time", "arguments": {"tz": "UTC"}}')
    r = oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, CLOCK],
                                   tool_choice="required")
    schema = engine.params.structured_outputs.json
    assert [s["properties"]["name"]["const"] for s in schema["anyOf"]] == ["get_weather", "get_time"]
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"tz": "UTC"})


def test_openai_response_format(scripted, oa):
    engine = say(scripted, '{"a": 1}')
    r = oa.chat.completions.create(model=NAME, messages=ASK,
                                   response_format={"type": "json_object"})
    assert engine.params.structured_outputs.json_object and r.choices[0].message.content == '{"a": 1}'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    oa.chat.completions.create(model=NAME, messages=ASK, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    assert engine.params.structured_outputs.json == {**schema, "additionalProperties": False}
    oa.chat.completions.create(model=NAME, messages=ASK, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": False}})
    assert engine.params.structured_outputs.json == schema  # not strict: as given
    # with auto tools, JSON output is not read as a tool call
    say(scripted, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    r = oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                   response_format={"type": "json_object"})
    assert not r.choices[0].message.tool_calls


def test_anthropic_forced_tool_and_any(scripted, an):
    engine = say(scripted, '{"city": "Paris"}')
    with an.messages.stream(model=NAME, max_tokens=64, messages=ASK, tools=[ANTHROPIC_WEATHER],
                            tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert engine.params.structured_outputs.json == {**ANTHROPIC_WEATHER["input_schema"],
                                                     "additionalProperties": False}
    (use,) = final.content
    assert use.type == "tool_use" and use.input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"
    say(scripted, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    m = an.messages.create(model=NAME, max_tokens=64, messages=ASK, tools=[ANTHROPIC_WEATHER],
                           tool_choice={"type": "any"})
    assert [(b.type, b.input) for b in m.content] == [("tool_use", {"city": "Oslo"})]


# ---- sessions: a turn that ends in a tool call hints that its session returns ------------
def test_tool_call_turns_hint_their_session(scripted, oa, an):
    engine = say(scripted, CALL)
    engine.hinted.clear()
    oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], user="u1")
    list(oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], stream=True,
                                    extra_body={"session_id": "s2"}))
    oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER])  # no session
    an.messages.create(model=NAME, max_tokens=50, messages=ASK, tools=[ANTHROPIC_WEATHER],
                       metadata={"user_id": "a3"})
    with an.messages.stream(model=NAME, max_tokens=50, messages=ASK, tools=[ANTHROPIC_WEATHER],
                            metadata={"user_id": "a4"}) as stream:
        stream.get_final_message()
    assert engine.hinted == ["u1", "s2", "a3", "a4"]
    say(scripted, "Just text.")
    oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], user="u5")
    assert engine.hinted == ["u1", "s2", "a3", "a4"]  # no tool call: no hint
