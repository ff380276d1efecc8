"""Tool-call parsers on model outputs, well-formed and malformed: the calls found, the
content kept, no crash, and streaming (at every chunking) saying what the whole-text
extraction says."""

from __future__ import annotations

import json

import pluggy
import pytest

from tokenmill.platforms.plugins import KINDS, TOOL_PARSER, PluginError, PluginManager
from tokenmill.platforms.tool_parsing import ContentDelta, ToolCallDelta, ToolCallStream, ToolParser
from tokenmill.server.tool_parsers import get_tool_parser, installed_tool_parsers

# Outputs in the shapes Hermes-2-Pro / Qwen2.5 emit (one call, parallel calls, text first)
HERMES_OK = {
    "qwen_one": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris, France", '
        '"unit": "celsius"}}\n</tool_call>',
        [("get_weather", {"location": "Paris, France", "unit": "celsius"})], None,
    ),
    "qwen_parallel": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>',
        [("get_weather", {"location": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})], None,
    ),
    "hermes_text_first": (
        "Let me look that up.\n<tool_call>\n{\"arguments\": {\"symbol\": \"TSLA\"}, "
        "\"name\": \"get_stock_fundamentals\"}\n</tool_call>",
        [("get_stock_fundamentals", {"symbol": "TSLA"})], "Let me look that up.\n",
    ),
    "unicode_and_nesting": (
        '<tool_call>{"name": "search", "arguments": {"q": "café \\"naïve\\" </b>", '
        '"filters": {"tags": ["a", "b"], "limit": 3}}}</tool_call>',
        [("search", {"q": 'café "naïve" </b>', "filters": {"tags": ["a", "b"], "limit": 3}})],
        None,
    ),
    "unclosed_but_complete": (  # cut by max_tokens right before the closing tag
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Oslo"}}\n',
        [("get_weather", {"location": "Oslo"})], None,
    ),
    "arguments_as_json_string": (
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        [("f", {"x": 1})], None,
    ),
    "no_arguments": ('<tool_call>{"name": "now"}</tool_call>', [("now", {})], None),
}

HERMES_MALFORMED = {
    "plain_text": "The weather in Paris is sunny.",
    "empty": "",
    "broken_json": '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Par\n</tool_call>',
    "cut_mid_json": '<tool_call>\n{"name": "get_weather", "argu',
    "no_name": '<tool_call>{"arguments": {"a": 1}}</tool_call>',
    "name_not_string": '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
    "arguments_not_object": '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
    "one_good_one_bad": (
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": </tool_call>'
    ),
    "marker_only": "<tool_call>",
    "partial_marker_text": "I would use <tool_ but no.",
    "json_list": "<tool_call>[1, 2, 3]</tool_call>",
}

# Llama 3.1/3.2 JSON tool calls (the built-in JSON format; <|python_tag|> when kept)
LLAMA_OK = {
    "llama_one": (
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
        '"unit": "Fahrenheit"}}',
        [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
        None,
    ),
    "python_tag": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
        [("get_weather", {"city": "Rome"})], None,
    ),
    "semicolon_separated": (
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        [("a", {"x": 1}), ("b", {})], None,
    ),
    "leading_blanks_and_arguments_key": (
        '\n  {"name": "a", "arguments": {"k": "v"}}', [("a", {"k": "v"})], None,
    ),
    "trailing_text": (
        '{"name": "a", "parameters": {}} I called a.', [("a", {})], "I called a.",
    ),
}

# Recorded: SmolLM2-135M-Instruct, greedy, with tools in the Hermes system message (it
# answers in prose, or writes JSON in a code block, never a call)
SMOLLM2_RECORDED = [
    "The weather in Paris is described as a mix of warm and cool. Paris is known for its "
    "beautiful Parisian culture, with a wide range of outdoor activities",
    'Here\'s a Python function that uses the `get_weather` tool to find the weather in Tokyo:'
    '\n\n```python\ndef get_weather_tokyo():\n    return {\n        "type": "weather",\n'
    '        "description": "Tokyo",\n        "location": "Tokyo",\n        "city": {\n'
    '            "type": "string",\n            "name": "Tokyo",',
]

LLAMA_MALFORMED = {
    "plain_text": "Sure! The answer is 4.",
    "empty": "",
    "text_then_json": 'Calling: {"name": "a", "parameters": {}}',
    "broken_json": '{"name": "a", "parameters": {"x": }',
    "cut": '<|python_tag|>{"name": "a", "param',
    "no_name": '{"parameters": {"x": 1}}',
    "parameters_not_object": '{"name": "a", "parameters": "nope"}',
    "second_call_broken": '{"name": "a", "parameters": {}}; {"name": ',
    "json_array": '[{"name": "a", "parameters": {}}]',
}

# The generic parser (`json`), for models with no known format: every layout a model
# without tool training tends to write
JSON_OK = {
    "bare_object": ('{"name": "get_weather", "arguments": {"city": "Paris"}}',
                    [("get_weather", {"city": "Paris"})], None),
    "parameters_key_then_text": ('  {"name": "a", "parameters": {"x": 1}}\nDone.',
                                 [("a", {"x": 1})], "Done."),
    "input_key": ('{"name": "Bash", "input": {"command": "ls"}}', [("Bash", {"command": "ls"})],
                  None),
    "list_of_calls": ('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": 2}}]',
                      [("a", {}), ("b", {"y": 2})], None),
    "openai_shape": ('{"type": "function", "function": {"name": "f", "arguments": "{\\"q\\": 1}"}}',
                     [("f", {"q": 1})], None),
    "fenced_after_text": ('I will check.\n```json\n{"name": "get_weather", "arguments": '
                          '{"city": "Oslo"}}\n```', [("get_weather", {"city": "Oslo"})],
                          "I will check.\n"),
    "hermes_blocks": ('<tool_call>{"name": "a", "arguments": {}}</tool_call>', [("a", {})], None),
    "semicolons": ('{"name": "a", "arguments": {}}; {"name": "b", "arguments": {}}',
                   [("a", {}), ("b", {})], None),
}

JSON_MALFORMED = {
    "plain_text": "The weather in Paris is sunny.",
    "empty": "",
    "object_not_a_call": '{"city": "Paris", "temperature": 21}',
    "broken": '{"name": "a", "arguments": {"x": }',
    "list_with_a_non_call": '[{"name": "a", "arguments": {}}, 3]',
    "fenced_code_not_a_call": "Here:\n```python\nprint({'name': 1})\n```\nBye.",
    "fenced_json_not_a_call": 'Data:\n```json\n{"rows": [1, 2]}\n```',
    "cut_in_fence": 'Sure\n```json\n{"name": "a", "argu',
}


def _check_calls(parser: ToolParser, text: str, expected, content) -> None:
    result = parser.extract_tool_calls(text)
    assert result.tools_called
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == expected
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in result.tool_calls)
    assert len({c.id for c in result.tool_calls}) == len(result.tool_calls)
    assert result.content == content


@pytest.mark.parametrize("case", sorted(HERMES_OK))
def test_hermes_finds_calls(case):
    text, expected, content = HERMES_OK[case]
    _check_calls(get_tool_parser("hermes")(), text, expected, content)


@pytest.mark.parametrize("case", sorted(LLAMA_OK))
def test_llama3_json_finds_calls(case):
    text, expected, content = LLAMA_OK[case]
    _check_calls(get_tool_parser("llama3_json")(), text, expected, content)


@pytest.mark.parametrize("case", sorted(JSON_OK))
def test_generic_json_finds_calls(case):
    text, expected, content = JSON_OK[case]
    _check_calls(get_tool_parser("json")(), text, expected, content)


@pytest.mark.parametrize(
    "name,text",
    [("hermes", t) for t in [*HERMES_MALFORMED.values(), *SMOLLM2_RECORDED]]
    + [("llama3_json", t) for t in [*LLAMA_MALFORMED.values(), *SMOLLM2_RECORDED]]
    + [("json", t) for t in [*JSON_MALFORMED.values(), *SMOLLM2_RECORDED]],
)
def test_malformed_output_is_all_content(name, text):
    result = get_tool_parser(name)().extract_tool_calls(text)
    assert not result.tools_called and result.tool_calls == []
    assert result.content == text


def _stream(parser: ToolParser, text: str, chunk: int):
    stream = ToolCallStream(parser)
    events = []
    for i in range(0, len(text), chunk):
        events += stream.feed(text[i:i + chunk])
    return events + stream.finish()


def _replay(events):
    content, calls = "", {}
    for e in events:
        if isinstance(e, ContentDelta):
            content += e.text
        else:
            assert isinstance(e, ToolCallDelta)
            if e.name is not None:  # the name comes first, with the id
                assert e.index not in calls and e.id
                calls[e.index] = [e.name, ""]
            calls[e.index][1] += e.arguments
    return content, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]


ALL_CASES = (
    [("hermes", t) for t, _, _ in HERMES_OK.values()] + [("hermes", t) for t in HERMES_MALFORMED.values()]
    + [("llama3_json", t) for t, _, _ in LLAMA_OK.values()]
    + [("llama3_json", t) for t in LLAMA_MALFORMED.values()]
    + [("json", t) for t, _, _ in JSON_OK.values()] + [("json", t) for t in JSON_MALFORMED.values()]
    + [(name, t) for name in ("hermes", "llama3_json", "json") for t in SMOLLM2_RECORDED]
)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("name,text", ALL_CASES)
def test_streaming_says_what_extraction_says(name, text, chunk):
    parser = get_tool_parser(name)()
    whole = parser.extract_tool_calls(text)
    content, calls = _replay(_stream(parser, text, chunk))
    assert calls == [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
    assert content == (whole.content or "")


def test_streaming_sends_leading_content_before_the_end():
    stream = ToolCallStream(get_tool_parser("hermes")())
    early = stream.feed("Checking the weather. ") + stream.feed("<tool_call>{\"name\": ")
    assert "".join(e.text for e in early) == "Checking the weather. "
    assert stream.feed('"f", "arguments": {}}</tool_call>') == []
    assert [type(e) for e in stream.finish()] == [ToolCallDelta, ToolCallDelta]


def test_ids_take_the_api_prefix():
    result = get_tool_parser("hermes")("toolu_").extract_tool_calls(HERMES_OK["qwen_one"][0])
    assert result.tool_calls[0].id.startswith("toolu_")


def test_parsers_are_plugins_found_by_the_manager():
    assert {"hermes", "llama3_json", "qwen3_coder", "mistral"} <= set(installed_tool_parsers())
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'.*hermes"):
        get_tool_parser("nope")


class _OtherPlugin:
    """An outside tool parser plugin, registered in-process beside the installed ones."""

    hookimpl = pluggy.HookimplMarker("tokenmill")

    def __init__(self, parsers: dict) -> None:
        self.parsers = parsers

    @hookimpl
    def tokenmill_api_version(self):
        return "1.6"

    @hookimpl
    def tokenmill_tool_parsers(self):
        return self.parsers


def test_an_outside_parser_plugin_is_chosen_by_name_and_checked():
    class Mine(ToolParser):
        pass

    plugins = PluginManager.discover(KINDS)
    plugins.register(_OtherPlugin({"mine": Mine}), TOOL_PARSER, "mine")
    assert get_tool_parser("mine", plugins) is Mine
    assert get_tool_parser("hermes", plugins) is installed_tool_parsers()["hermes"]

    clash = PluginManager.discover([TOOL_PARSER])
    clash.register(_OtherPlugin({"hermes": Mine}), TOOL_PARSER, "other")
    with pytest.raises(PluginError, match="tool_parser 'hermes' is provided by two plugins"):
        installed_tool_parsers(clash)

    bad = PluginManager()
    bad.register(_OtherPlugin({"x": dict}), TOOL_PARSER, "bad")
    with pytest.raises(PluginError, match="tool_parser plugin 'bad'.*'x' is <class 'dict'>, not a "
                                          "ToolParser subclass"):
        installed_tool_parsers(bad)
