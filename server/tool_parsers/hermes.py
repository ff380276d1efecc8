"""Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more.

Text around the blocks is content. A last block the output ends inside (no closing tag,
e.g. cut by max_tokens) counts if its JSON is complete.
"""

from __future__ import annotations

import json
import re

from tokenmill.platforms.tool_parsing import (
    ExtractedToolCalls,
    ToolParser,
    not_called,
    parse_call,
    partial_marker_start,
)

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.DOTALL)


class HermesToolParser(ToolParser):
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return not_called(text)
        calls, pieces, pos = [], [], 0
        for m in _BLOCK.finditer(text):
            pieces.append(text[pos:m.start()])
            pos = m.end()
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError:
                return not_called(text)
            call = parse_call(obj, self.id_prefix, ("arguments", "parameters"))
            if call is None:
                return not_called(text)
            calls.append(call)
        pieces.append(text[pos:])
        content = "".join(pieces)
        return ExtractedToolCalls(True, calls, content if content.strip() else None)

    def section_start(self, text: str) -> tuple[int, bool] | None:
        i = text.find(START)
        if i >= 0:
            return i, True
        j = partial_marker_start(text, START)
        return None if j is None else (j, False)
