"""Chat rendering with tools: a template that reads `tools` gets them; one that does not
gets them written into the conversation (Hermes form), and each agent turn's prompt
extends the previous one's prompt plus the model's reply (prefix-cache hits)."""

from __future__ import annotations

import json

import pytest
from tiny_models import CHAT_TEMPLATE, make_tokenizer

from tokenmill.frontend.tokenizing import apply_chat_template, template_reads_tools

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
READS_TOOLS = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}" + CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(300)


def test_template_reads_tools():
    assert template_reads_tools(READS_TOOLS)
    assert not template_reads_tools(CHAT_TEMPLATE)
    assert not template_reads_tools("{{ 'tools' }}{% for m in messages %}{{ m.content }}{% endfor %}")


def test_template_with_tools_gets_them(tok):
    text = apply_chat_template(tok, [{"role": "user", "content": "hi"}], READS_TOOLS, tools=TOOLS)
    assert text.startswith("[get_weather]") and "<tools>" not in text


def test_template_without_tools_gets_a_hermes_system_message(tok):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = apply_chat_template(tok, conv, CHAT_TEMPLATE, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text and "<tool_call>" in text
    assert text.count("<|im_start|>system") == 1
    plain = apply_chat_template(tok, conv, CHAT_TEMPLATE)
    assert "# Tools" not in plain  # no tools, no change


def test_each_turn_extends_the_last(tok):
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    conv = [{"role": "user", "content": "Weather in Paris?"}]
    turn1 = apply_chat_template(tok, conv, CHAT_TEMPLATE, tools=TOOLS)
    conv += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "22C"},
             {"role": "tool", "tool_call_id": "c2", "content": "windy"}]
    turn2 = apply_chat_template(tok, conv, CHAT_TEMPLATE, tools=TOOLS)
    assert turn2.startswith(turn1 + reply)
    assert "<tool_response>\n22C\n</tool_response>\n<tool_response>\nwindy\n</tool_response>" in turn2
    assert turn2.count("<|im_start|>user") == 2  # both results in one user turn
