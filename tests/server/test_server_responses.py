"""The OpenAI Responses API through the real `openai` SDK against a real server on a tiny
random model: plain and streamed answers, forced function calls, a function-calling loop
over `previous_response_id`, the store, structured text output, and the 400/404s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from conftest import TINY_NAME, running_server, tiny_engine

from tokenmill.server.app import build_app

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": WEATHER_SCHEMA}
CLOCK_SCHEMA = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                          "maximum": 23}},
                "required": ["hour"], "additionalProperties": False}
CLOCK = {"type": "function", "name": "set_clock", "parameters": CLOCK_SCHEMA}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "set_clock": CLOCK_SCHEMA}
GREEDY = {"temperature": 0}
# A template that reads `tools` (so the server does not write them out in the long Hermes
# layout) and stays short enough for the tiny model's 512-token context.
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = tiny_engine(tiny_model, chat_template=TEMPLATE)
    # compact JSON: with optional whitespace the random model writes tabs until max_tokens
    with running_server(build_app(engine, [TINY_NAME], compact_json=True)) as url:
        yield url


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)


def test_plain_response_matches_chat_completion(client):
    r = client.responses.create(model=TINY_NAME, input="Paris is the capital of",
                                max_output_tokens=8, **GREEDY)
    chat = client.chat.completions.create(
        model=TINY_NAME, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "Paris is the capital of"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == TINY_NAME
    assert r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].id.startswith("msg_")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"


def test_instructions_and_items_are_the_chat_conversation(client):
    items = [{"role": "user", "content": "Hello"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hi"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Berlin is"}]}]
    r = client.responses.create(model=TINY_NAME, input=items, instructions="Be terse.",
                                max_output_tokens=6, **GREEDY)
    chat = client.chat.completions.create(
        model=TINY_NAME, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Be terse."},
                  {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
                  {"role": "user", "content": "Berlin is"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.instructions == "Be terse."


def test_stream_events_in_order_and_deltas_make_the_text(client):
    kwargs = dict(model=TINY_NAME, input="The quick brown fox", max_output_tokens=12, **GREEDY)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete"
                          else "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == whole.output_text == final.output_text
    assert events[-4].text == text
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the SDK's stream helper accumulates the same events without complaint (its
    # get_final_response wants response.completed, and this one may be incomplete)
    with client.responses.stream(**kwargs) as stream:
        snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
    assert snapshots[-1] == text


@pytest.mark.parametrize("choice", [{"type": "function", "name": "set_clock"}, "required"])
def test_forced_function_call_validates(client, choice):
    r = client.responses.create(model=TINY_NAME, input="Set the clock", tools=[WEATHER, CLOCK],
                                tool_choice=choice, max_output_tokens=100, **GREEDY)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_")
    assert calls[0].id.startswith("fc_")
    if isinstance(choice, dict):
        assert calls[0].name == "set_clock"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    assert r.tool_choice == choice or r.tool_choice.name == "set_clock"


def test_forced_function_call_streamed(client):
    kwargs = dict(model=TINY_NAME, input="Weather?", tools=[WEATHER], max_output_tokens=40,
                  tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:-1] == ["response.function_call_arguments.done", "response.output_item.done"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-3].arguments == whole.output[0].arguments
    done = events[-2].item
    assert done.call_id == events[2].item.call_id and done.name == "get_weather"
    jsonschema.validate(json.loads(args), WEATHER_SCHEMA)


def test_three_turn_function_loop_over_previous_response_id(client):
    """Two forced calls, each answered with its output item, then a text answer: every turn
    sees the whole conversation (same tokens as sending it all explicitly), the prefix
    cache serves the earlier turns, and each response can be fetched by id."""
    first = client.responses.create(model=TINY_NAME, input="Weather in Paris, then set the clock",
                                    tools=[WEATHER, CLOCK], tool_choice="required",
                                    max_output_tokens=100, **GREEDY)
    history: list = [{"role": "user", "content": "Weather in Paris, then set the clock"}]
    previous = first
    for turn, choice in enumerate(["required", "none"]):
        (call,) = [i for i in previous.output if i.type == "function_call"]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        result = {"type": "function_call_output", "call_id": call.call_id,
                  "output": f"result {turn}"}
        nxt = client.responses.create(model=TINY_NAME, input=[result], tools=[WEATHER, CLOCK],
                                      previous_response_id=previous.id, tool_choice=choice,
                                      max_output_tokens=100 if choice == "required" else 8,
                                      **GREEDY)
        history += [call.model_dump(exclude_none=True), result]
        explicit = client.responses.create(model=TINY_NAME, input=history, tools=[WEATHER, CLOCK],
                                           tool_choice=choice, store=False,
                                           max_output_tokens=100 if choice == "required" else 8,
                                           **GREEDY)
        assert nxt.previous_response_id == previous.id
        assert nxt.usage.input_tokens == explicit.usage.input_tokens
        assert nxt.usage.input_tokens > previous.usage.input_tokens
        assert nxt.usage.input_tokens_details.cached_tokens > 0
        assert [i.type for i in nxt.output] == [i.type for i in explicit.output]
        previous = nxt
    assert [i.type for i in previous.output] == ["message"]
    assert previous.output_text == explicit.output_text
    fetched = client.responses.retrieve(previous.id)
    assert fetched.id == previous.id and fetched.output_text == previous.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(explicit.id)  # store=false


def test_unknown_previous_response_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=TINY_NAME, input="hi", previous_response_id="resp_nope")
    assert "resp_nope" in str(e.value) and e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer", "n"], "additionalProperties": False}
    r = client.responses.create(
        model=TINY_NAME, input="Answer in JSON", max_output_tokens=100, **GREEDY,
        text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"

    class Answer(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        answer: str = pydantic.Field(max_length=10)
        ok: bool

    parsed = client.responses.parse(model=TINY_NAME, input="Answer", text_format=Answer,
                                    max_output_tokens=60, **GREEDY)
    assert isinstance(parsed.output_parsed, Answer)


def test_bad_requests_are_400(client, base_url):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=TINY_NAME, input="x", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "nope"})
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model=TINY_NAME, input=[{"type": "function_call", "call_id": "c", "name": "f",
                                     "arguments": "not json"}])
    r = httpx.post(f"{base_url}/v1/responses", json={"model": TINY_NAME, "input": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_store_is_bounded_and_evicts_oldest(tiny_model):
    engine = tiny_engine(tiny_model, num_kv_blocks=256)
    app = build_app(engine, [TINY_NAME], max_stored_responses=2)
    with running_server(app) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        ids = [c.responses.create(model=TINY_NAME, input=f"q{i}", max_output_tokens=2).id
               for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[0])
        assert c.responses.retrieve(ids[2]).id == ids[2]
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model=TINY_NAME, input="more", previous_response_id=ids[0])
