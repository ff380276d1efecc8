"""Reasoning parsers: on scripted text (every chunking of a stream says what the whole
output says), through all three APIs on a server whose engine answers a scripted
reasoning output, and end to end with a tiny model through the qwen3 parser."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest
from conftest import TINY_NAME, running_server, tiny_engine
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server_tools import CALL, WEATHER, ScriptedLLM

from tokenmill.platforms.reasoning import ReasoningDelta
from tokenmill.platforms.tool_parsing import ContentDelta, ToolCallDelta
from tokenmill.server.app import build_app
from tokenmill.server.output import OutputEvents, split_output
from tokenmill.server.reasoning import get_reasoning_parser, installed_reasoning_parsers
from tokenmill.server.serving import ToolConfig
from tokenmill.server.tool_parsers import get_tool_parser
from tokenmill.server.tools import plan_tools

# (parser, prompt end, output) -> (reasoning, content)
CASES = [
    ("qwen3", "", "<think>Let me see.</think>\n\nParis.", ("Let me see.", "Paris.")),
    ("qwen3", "", "  <think>\nstep 1\n</think>Paris", ("\nstep 1\n", "Paris")),
    ("qwen3", "<think>\n", "step 1</think>\n\nParis", ("step 1", "Paris")),  # opened in the prompt
    ("qwen3", "", "Paris, no thinking.", (None, "Paris, no thinking.")),
    ("qwen3", "", "a </think> b", (None, "a </think> b")),  # not thinking: the marker is text
    ("qwen3", "", "<think>cut by max_tok", ("cut by max_tok", "")),
    ("qwen3", "", "<thin", (None, "<thin")),
    ("qwen3", "", "", (None, "")),
    ("deepseek_r1", "<think>\n", "reason</think>answer", ("reason", "answer")),
    ("deepseek_r1", "", "<think>reason</think>answer", ("reason", "answer")),
    ("deepseek_r1", "", "all reasoning, never closed", ("all reasoning, never closed", "")),
    ("deepseek_r1", "", "</think>only answer", ("", "only answer")),
]


@pytest.mark.parametrize("name,prompt,text,expected", CASES)
def test_extract(name, prompt, text, expected):
    assert get_reasoning_parser(name)().extract("<|im_start|>assistant\n" + prompt, text) == expected


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_stream_at_any_chunking_says_what_extract_says(case, cuts):
    name, prompt, text, (reasoning, content) = case
    stream = get_reasoning_parser(name)().stream(prompt)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = []
    for lo, hi in zip(bounds, bounds[1:]):
        pieces += stream.feed(text[lo:hi])
    pieces += stream.finish()
    assert "".join(p.text for p in pieces if isinstance(p, ReasoningDelta)) == (reasoning or "")
    assert "".join(p.text for p in pieces if not isinstance(p, ReasoningDelta)) == content


@pytest.mark.parametrize("name,prompt,text,expected", CASES)
def test_stream_at_every_two_cuts_says_what_extract_says(name, prompt, text, expected):
    reasoning, content = expected
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            stream = get_reasoning_parser(name)().stream(prompt)
            pieces = stream.feed(text[:i]) + stream.feed(text[i:j]) + stream.feed(text[j:])
            pieces += stream.finish()
            got = ("".join(p.text for p in pieces if isinstance(p, ReasoningDelta)),
                   "".join(p.text for p in pieces if not isinstance(p, ReasoningDelta)))
            assert got == (reasoning or "", content), (i, j)


def test_registry():
    assert {"qwen3", "deepseek_r1"} <= set(installed_reasoning_parsers())
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")


HF_WEATHER = [WEATHER]
AUTO = ToolConfig(True, get_tool_parser("hermes"))


@pytest.mark.parametrize("text,reasoning,content", [
    ("<think>need the weather</think>\n" + CALL, "need the weather", None),  # after
    ("<think>I will call " + CALL + "</think>", "I will call ", None),  # inside
    ("<think>no call</think>Sunny.", "no call", "Sunny."),
])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_tool_calls_after_or_inside_reasoning_still_parse(text, reasoning, content, chunk):
    plan = plan_tools(HF_WEATHER, "auto", AUTO)
    parser = get_reasoning_parser("qwen3")()
    split = split_output(plan, parser, "", text)
    assert split.reasoning == reasoning and split.content == content
    called = "<tool_call>" in text
    assert split.found.tools_called == called
    if called:
        assert [(c.name, json.loads(c.arguments)) for c in split.found.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
    events = OutputEvents(plan, parser, "")
    out = []
    for i in range(0, len(text), chunk):
        out += events.feed(text[i:i + chunk])
    out += events.finish()
    assert events.called == called
    assert "".join(e.arguments for e in out if isinstance(e, ToolCallDelta)) == (
        '{"city": "Paris"}' if called else "")
    assert "".join(e.text for e in out if isinstance(e, ContentDelta)) == (content or "")
    streamed_reasoning = "".join(e.text for e in out if isinstance(e, ReasoningDelta))
    # a call inside the thinking went out as thinking text before it was found
    assert streamed_reasoning == (text.split("<think>")[1].split("</think>")[0])


# ---- scripted reasoning through the three APIs ------------------------------------------
THINKING_TEMPLATE = (
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}"
)
THOUGHT = "<think>The user asks about Paris.</think>\n\nParis is in France."


@pytest.fixture(scope="module")
def scripted(tiny_model):
    real = tiny_engine(tiny_model, chat_template=THINKING_TEMPLATE, num_kv_blocks=256)
    engine = ScriptedLLM(engine=real.engine)
    app = build_app(engine, ["scripted"], enable_auto_tool_choice=True,
                    tool_call_parser="hermes", reasoning_parser="qwen3")
    with running_server(app) as url:
        yield url, engine


def test_chat_reasoning_content(scripted):
    url, engine = scripted
    engine.script = THOUGHT
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    ask = [{"role": "user", "content": "Where is Paris?"}]
    m = oa.chat.completions.create(model="scripted", messages=ask).choices[0].message
    assert m.reasoning_content == "The user asks about Paris."
    assert m.content == "Paris is in France."
    chunks = list(oa.chat.completions.create(model="scripted", messages=ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == m.reasoning_content
    assert "".join(d.content or "" for d in deltas) == m.content
    engine.script = "<think>check</think>" + CALL
    r = oa.chat.completions.create(model="scripted", messages=ask, tools=[WEATHER])
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.reasoning_content == "check"
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    # enable_thinking=false reaches the template, and the answer is not split
    engine.script = "Paris."
    r = oa.chat.completions.create(model="scripted", messages=ask,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert engine.prompt.endswith("<think>\n\n</think>\n\n")
    assert r.choices[0].message.content == "Paris." and not getattr(
        r.choices[0].message, "reasoning_content", None)


def test_responses_reasoning_item(scripted):
    url, engine = scripted
    engine.script = THOUGHT
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    r = oa.responses.create(model="scripted", input="Where is Paris?")
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].id.startswith("rs_")
    assert r.output[0].content[0].text == "The user asks about Paris."
    assert r.output_text == "Paris is in France."
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(oa.responses.create(model="scripted", input="Where is Paris?", stream=True))
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.done") < first_text
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning"
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "The user asks about Paris."
    assert events[-1].type == "response.completed"
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    # the reasoning goes back to the template as reasoning_content on the next turn
    nxt = oa.responses.create(model="scripted", input="And Berlin?", previous_response_id=r.id)
    assert "Paris is in France." in engine.prompt and nxt.previous_response_id == r.id


def test_effort_reaches_the_template(scripted):
    url, engine = scripted
    engine.script = "ok"
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    ask = [{"role": "user", "content": "hi"}]
    oa.chat.completions.create(model="scripted", messages=ask, reasoning_effort="low")
    assert engine.prompt.startswith("effort=low\n")
    oa.responses.create(model="scripted", input="hi", reasoning={"effort": "high"})
    assert engine.prompt.startswith("effort=high\n")
    an.messages.create(model="scripted", max_tokens=5, messages=ask,
                       output_config={"effort": "medium"})
    assert engine.prompt.startswith("effort=medium\n")
    oa.chat.completions.create(model="scripted", messages=ask)
    assert engine.prompt.startswith("<|im_start|>")


def test_anthropic_thinking_blocks(scripted):
    url, engine = scripted
    engine.script = THOUGHT
    an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    ask = [{"role": "user", "content": "Where is Paris?"}]
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}, None):
        kw = {} if thinking is None else {"thinking": thinking}
        m = an.messages.create(model="scripted", max_tokens=50, messages=ask, **kw)
        assert m.id.startswith("msg_")
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert m.content[0].thinking == "The user asks about Paris."
        assert m.content[1].text == "Paris is in France."
    with an.messages.stream(model="scripted", max_tokens=50, messages=ask,
                            thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == m.content[0].thinking
    assert final.content[1].text == m.content[1].text
    omitted = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    m = an.messages.create(model="scripted", max_tokens=50, messages=ask, thinking=omitted)
    assert [(b.type, getattr(b, "thinking", None)) for b in m.content] == [
        ("thinking", ""), ("text", None)]
    with an.messages.stream(model="scripted", max_tokens=50, messages=ask,
                            thinking=omitted) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" not in kinds and final.content[0].type == "thinking"
    assert final.content[0].thinking == "" and final.content[1].text == "Paris is in France."
    # disabled: the template is told, and nothing is split off as thinking
    engine.script = "Paris."
    m = an.messages.create(model="scripted", max_tokens=50, messages=ask,
                           thinking={"type": "disabled"})
    assert engine.prompt.endswith("<think>\n\n</think>\n\n")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Paris."
    # thinking blocks sent back in an assistant turn are accepted
    engine.script = THOUGHT
    an.messages.create(model="scripted", max_tokens=50, messages=[
        *ask, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "earlier", "signature": ""},
            {"type": "text", "text": "Paris is in France."}]},
        {"role": "user", "content": "And Berlin?"}])
    engine.script = "<think>look it up</think>" + CALL
    m = an.messages.create(model="scripted", max_tokens=50, messages=ask,
                           tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}])
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[1].id.startswith("toolu_") and m.content[1].input == {"city": "Paris"}
    assert m.stop_reason == "tool_use"


# ---- a tiny model through the qwen3 parser ------------------------------------------------
SHAPE = r"<think>[a-z ]{1,12}</think>[a-z]{1,8}"


def test_tiny_model_through_qwen3_parser(tiny_model, base_url):
    """The tiny model writes `<think>...</think>answer` (its output held to that shape by
    vLLM's structured_outputs extra, a regex); the server with `--reasoning-parser qwen3`
    splits exactly what the same request returns whole from a server without one."""
    body = {"model": TINY_NAME, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "Think, then answer."}],
            "structured_outputs": {"regex": SHAPE}}
    raw = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).json()
    raw_text = raw["choices"][0]["message"]["content"]
    assert re.fullmatch(SHAPE, raw_text), raw_text
    engine = tiny_engine(tiny_model, num_kv_blocks=256)
    with running_server(build_app(engine, [TINY_NAME], reasoning_parser="qwen3")) as url:
        split = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        message = split["choices"][0]["message"]
        assert f"<think>{message['reasoning_content']}</think>{message['content']}" == raw_text
        chunks = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True},
                            timeout=60).text
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in chunks.splitlines()
              if line.startswith("data: {")]
    deltas = [d for d in deltas if d]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
