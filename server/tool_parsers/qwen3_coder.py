"""Qwen3-Coder XML tool calls, one or more:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is typed by its parameter's schema in the request's
tools (string kept, numbers and booleans converted, objects and arrays read as JSON; an
unknown parameter is read as JSON when it is JSON, else kept as text). Text around the
calls is content; `<tool_call>` may be missing around a `<function=...>` block.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenmill.platforms.tool_parsing import (
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    new_tool_call_id,
    not_called,
    partial_marker_start,
)

MARKERS = ("<tool_call>", "<function=")
_CALL = re.compile(
    r"(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)(?:</function>\s*(?:</tool_call>)?|\Z)", re.DOTALL
)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _typed(value: str, schema: dict[str, Any] | None) -> Any:
    kind = (schema or {}).get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds:
        return value
    if value == "null":
        return None
    if "boolean" in kinds and value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        if "integer" in kinds:
            return int(value)
        if "number" in kinds:
            number = float(value)
            return int(number) if number.is_integer() and "." not in value else number
    except ValueError:
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


class Qwen3CoderToolParser(ToolParser):
    def _schemas(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            fn = t.get("function", t)
            if fn.get("name") == name:
                return (fn.get("parameters") or {}).get("properties") or {}
        return {}

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if "<function=" not in text:
            return not_called(text)
        calls, pieces, pos = [], [], 0
        for m in _CALL.finditer(text):
            pieces.append(text[pos:m.start()])
            pos = m.end()
            name = m.group(1).strip()
            if not name:
                return not_called(text)
            props = self._schemas(name)
            args = {}
            for p in _PARAM.finditer(m.group(2)):
                key = p.group(1).strip()
                value = p.group(2).removeprefix("\n").removesuffix("\n")
                args[key] = _typed(value, props.get(key))
            calls.append(ToolCall(new_tool_call_id(self.id_prefix), name,
                                  json.dumps(args, ensure_ascii=False)))
        if not calls:
            return not_called(text)
        pieces.append(text[pos:])
        content = "".join(pieces).replace("</tool_call>", "")
        return ExtractedToolCalls(True, calls, content if content.strip() else None)

    def section_start(self, text: str) -> tuple[int, bool] | None:
        found = [i for i in (text.find(m) for m in MARKERS) if i >= 0]
        if found:
            return min(found), True
        partial = [j for j in (partial_marker_start(text, m) for m in MARKERS) if j is not None]
        return (min(partial), False) if partial else None
