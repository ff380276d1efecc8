"""The Qwen3-Coder XML and Mistral tool-call parsers (outputs in the shapes those models
write, and malformed ones), and the parser chosen from a chat template."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import TINY_NAME, tiny_engine
from test_tool_parsers import _check_calls, _replay, _stream

from tokenmill.server.app import build_app
from tokenmill.server.tool_parsers import get_tool_parser
from tokenmill.server.tool_parsers.detect import detect_tool_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "location": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}, "scale": {"type": "number"},
        "filters": {"type": "object"}, "tags": {"type": "array"}}}}}]

QWEN3_CODER_OK = {
    "one": (
        "<tool_call>\n<function=get_weather>\n<parameter=location>\nSan Francisco, CA\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        [("get_weather", {"location": "San Francisco, CA", "days": 3})], None,
    ),
    "typed_values": (
        "<tool_call>\n<function=get_weather>\n<parameter=metric>\ntrue\n</parameter>\n"
        "<parameter=scale>\n1.5\n</parameter>\n<parameter=filters>\n{\"a\": [1]}\n"
        "</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n<parameter=location>\n42\n"
        "</parameter>\n</function>\n</tool_call>",
        [("get_weather", {"metric": True, "scale": 1.5, "filters": {"a": [1]}, "tags": ["x"],
                          "location": "42"})], None,
    ),
    "text_first_and_two_calls": (
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=location>\nOslo\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n"
        "</tool_call>",
        [("get_weather", {"location": "Oslo"}), ("now", {})], "Checking.\n\n",
    ),
    "multiline_value_and_unknown_parameter": (
        "<tool_call>\n<function=write>\n<parameter=code>\ndef f():\n    return 1\n</parameter>\n"
        "<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>",
        [("write", {"code": "def f():\n    return 1", "n": 7})], None,
    ),
    "no_tool_call_tag_and_cut": (  # cut by max_tokens inside the last parameter
        "<function=get_weather>\n<parameter=location>\nRome",
        [("get_weather", {"location": "Rome"})], None,
    ),
}
QWEN3_CODER_MALFORMED = ["plain text", "", "<tool_call>", "<function=>\n</function>",
                         "see <function= here", "<tool_call>\n<function"]

MISTRAL_OK = {
    "json_list": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris", "days": 2}}]',
        [("get_weather", {"location": "Paris", "days": 2})], None,
    ),
    "json_list_two": (
        'Sure.[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]',
        [("a", {}), ("b", {"x": 1})], "Sure.",
    ),
    "v11_layout": (
        '[TOOL_CALLS]get_weather[ARGS]{"location": "Lyon"}[TOOL_CALLS]now[ARGS]{}',
        [("get_weather", {"location": "Lyon"}), ("now", {})], None,
    ),
}
MISTRAL_MALFORMED = ["plain", "", "[TOOL_CALLS]", "[TOOL_CALLS]{broken", "[TOOL_CALLS]f[ARGS]",
                     '[TOOL_CALLS][{"arguments": {}}]', "[TOOL_CALLS]f[ARGS][1]"]


@pytest.mark.parametrize("case", sorted(QWEN3_CODER_OK))
def test_qwen3_coder_finds_typed_calls(case):
    text, expected, content = QWEN3_CODER_OK[case]
    _check_calls(get_tool_parser("qwen3_coder")("call_", TOOLS), text, expected, content)


@pytest.mark.parametrize("case", sorted(MISTRAL_OK))
def test_mistral_finds_calls(case):
    text, expected, content = MISTRAL_OK[case]
    _check_calls(get_tool_parser("mistral")(), text, expected, content)


@pytest.mark.parametrize("name,text", [("qwen3_coder", t) for t in QWEN3_CODER_MALFORMED]
                         + [("mistral", t) for t in MISTRAL_MALFORMED])
def test_malformed_is_all_content(name, text):
    result = get_tool_parser(name)("call_", TOOLS).extract_tool_calls(text)
    assert not result.tools_called and result.content == text


CASES = ([("qwen3_coder", t) for t, _, _ in QWEN3_CODER_OK.values()]
         + [("mistral", t) for t, _, _ in MISTRAL_OK.values()]
         + [("qwen3_coder", t) for t in QWEN3_CODER_MALFORMED]
         + [("mistral", t) for t in MISTRAL_MALFORMED])


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("name,text", CASES)
def test_streaming_says_what_extraction_says(name, text, chunk):
    parser = get_tool_parser(name)("call_", TOOLS)
    whole = parser.extract_tool_calls(text)
    content, calls = _replay(_stream(parser, text, chunk))
    assert calls == [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
    assert content == (whole.content or "")


# Excerpts of the real templates' tool sections (the parts that show the format)
QWEN3_CODER_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>"
    "If you choose to call a function ONLY reply in the following format:\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n</function>\n</tool_call>{% endif %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
)
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>"
    "For each function call, return a json object within <tool_call></tool_call> XML tags"
    "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
)
LLAMA3_TEMPLATE = (
    "{% if tools %}Respond in the format {\"name\": function name, \"parameters\": dictionary}"
    "{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}{% for m in messages %}"
    "{% if m.tool_calls %}<|python_tag|>{{ m.tool_calls | tojson }}{% endif %}{{ m.content }}"
    "{% endfor %}"
)
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}"
    "{% endif %}{{ m.content }}{% endfor %}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}"
)


@pytest.mark.parametrize("template,expected", [
    (QWEN3_CODER_TEMPLATE, "qwen3_coder"), (HERMES_TEMPLATE, "hermes"),
    (LLAMA3_TEMPLATE, "llama3_json"), (MISTRAL_TEMPLATE, "mistral"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),  # reads no tools
    ("{% if tools %}{{ tools }}{% endif %}", None),  # tools, but no known format
    (HERMES_TEMPLATE + "<|python_tag|>", None),  # two formats: not clear
    (None, None),
])
def test_parser_from_template(template, expected):
    name, why = detect_tool_parser(template)
    assert name == expected and why


def test_server_says_which_parser_it_chose(tiny_model, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.server")
    app = build_app(tiny_engine(tiny_model, chat_template=QWEN3_CODER_TEMPLATE, num_kv_blocks=64),
                    [TINY_NAME], enable_auto_tool_choice=True)
    assert app.state.server.tools.tool_call_parser is get_tool_parser("qwen3_coder")
    assert "tool-call parser: chose qwen3_coder" in caplog.text
    app = build_app(tiny_engine(tiny_model, chat_template=HERMES_TEMPLATE + "<|python_tag|>",
                                num_kv_blocks=64), [TINY_NAME], enable_auto_tool_choice=True)
    assert app.state.server.tools.tool_call_parser is get_tool_parser("json")
    assert "using json, the generic one, since the chat template shows several" in caplog.text
