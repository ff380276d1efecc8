"""The generic JSON tool-call parser (`json`): the server's choice when the chat template
shows no known format (or several), so that auto tool choice works on any model.

A model with no trained format writes calls as JSON objects (`{"name": ..., "arguments":
{...}}`, `"parameters"` or `"input"` for the arguments, or OpenAI's `{"type":
"function", "function": {...}}`), alone or in a list, and in one of three places:

- `<tool_call>...</tool_call>` blocks (the Hermes layout the server writes tools in for
  templates that do not read them);
- fenced code blocks (```json ... ```), text around them being content;
- the whole output, after blanks: one or more objects (`;` or blanks between them), or
  one list of them; text after the last call is content.

Anything else (a JSON object that is not a call, prose that merely contains braces) is
content, unchanged.
"""

from __future__ import annotations

import json
import re

from tokenmill.platforms.tool_parsing import (
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    not_called,
    parse_call,
    partial_marker_start,
)
from tokenmill.server.tool_parsers.hermes import START, HermesToolParser

_ARGS_KEYS = ("arguments", "parameters", "input")
_FENCE = re.compile(r"```[a-zA-Z_]*[ \t]*\n?(.*?)(?:```|\Z)", re.DOTALL)
_FENCE_START = "```"


def _call(obj: object, id_prefix: str) -> ToolCall | None:
    if isinstance(obj, dict) and obj.get("type") == "function" and isinstance(
        obj.get("function"), dict
    ):
        obj = obj["function"]
    return parse_call(obj, id_prefix, _ARGS_KEYS)


def _calls(value: object, id_prefix: str) -> list[ToolCall] | None:
    """The calls `value` holds (one object or a non-empty list of them), else None."""
    items = value if isinstance(value, list) and value else [value]
    calls = [_call(v, id_prefix) for v in items]
    return None if any(c is None for c in calls) else calls


class GenericJsonToolParser(ToolParser):
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if START in text:
            return HermesToolParser(self.id_prefix, self.tools).extract_tool_calls(text)
        s = text.lstrip()
        if s.startswith(("{", "[")):
            return self._leading(text, s)
        if _FENCE_START in text:
            return self._fenced(text)
        return not_called(text)

    def _leading(self, text: str, s: str) -> ExtractedToolCalls:
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(s) and s[pos] in "{[":
            try:
                value, pos = decoder.raw_decode(s, pos)
            except json.JSONDecodeError:
                return not_called(text)
            found = _calls(value, self.id_prefix)
            if found is None:
                return not_called(text)
            calls += found
            rest = s[pos:].lstrip()
            rest = rest[1:].lstrip() if rest.startswith(";") else rest
            pos = len(s) - len(rest)
        content = s[pos:]
        return ExtractedToolCalls(True, calls, content if content.strip() else None)

    def _fenced(self, text: str) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        pieces, pos = [], 0
        for m in _FENCE.finditer(text):
            try:
                found = _calls(json.loads(m.group(1)), self.id_prefix)
            except json.JSONDecodeError:
                found = None
            if found is None:  # a code block that is no call stays content
                continue
            pieces.append(text[pos:m.start()])
            pos = m.end()
            calls += found
        if not calls:
            return not_called(text)
        pieces.append(text[pos:])
        content = "".join(pieces)
        return ExtractedToolCalls(True, calls, content if content.strip() else None)

    def section_start(self, text: str) -> tuple[int, bool] | None:
        s = text.lstrip()
        if s.startswith(("{", "[")):
            return len(text) - len(s), True
        starts = [i for i in (text.find(START), text.find(_FENCE_START)) if i >= 0]
        if starts:
            return min(starts), True
        partial = [j for j in (partial_marker_start(text, START),
                               partial_marker_start(text, _FENCE_START)) if j is not None]
        return (min(partial), False) if partial else None
