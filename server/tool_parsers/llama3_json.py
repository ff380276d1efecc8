"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, possibly after
`<|python_tag|>`, several separated by `;`. Only an output that starts with a call (after
blanks) holds calls; text after the last call is content."""

from __future__ import annotations

import json

from tokenmill.platforms.tool_parsing import (
    ExtractedToolCalls,
    ToolParser,
    not_called,
    parse_call,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        s = text.lstrip()
        s = s.removeprefix(PYTHON_TAG).lstrip()
        if not s.startswith("{"):
            return not_called(text)
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(s) and s[pos] == "{":
            try:
                obj, pos = decoder.raw_decode(s, pos)
            except json.JSONDecodeError:
                return not_called(text)
            call = parse_call(obj, self.id_prefix, ("parameters", "arguments"))
            if call is None:
                return not_called(text)
            calls.append(call)
            rest = s[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            pos = len(s) - len(rest)
        content = s[pos:]
        return ExtractedToolCalls(True, calls, content if content.strip() else None)

    def section_start(self, text: str) -> tuple[int, bool] | None:
        s = text.lstrip()
        i = len(text) - len(s)
        if not s:
            return None
        if s.startswith("{") or s.startswith(PYTHON_TAG):
            return i, True
        if PYTHON_TAG.startswith(s):
            return i, False
        return None
