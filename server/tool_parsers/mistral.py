"""Mistral tool calls after the `[TOOL_CALLS]` token, in either of its two layouts:

- `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11);
- `[TOOL_CALLS]name[ARGS]{...}`, repeated for several calls (v11 and later).

Text before the first `[TOOL_CALLS]` is content. `[TOOL_CALLS]` is a special token, so
requests parsed with this format keep special tokens in the output.
"""

from __future__ import annotations

import json

from tokenmill.platforms.tool_parsing import (
    ExtractedToolCalls,
    ToolParser,
    not_called,
    parse_call,
    partial_marker_start,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    keeps_special_tokens = True

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        i = text.find(TOOL_CALLS)
        if i < 0:
            return not_called(text)
        content, calls = text[:i], []
        decoder = json.JSONDecoder()
        for segment in text[i:].split(TOOL_CALLS)[1:]:
            segment = segment.strip()
            if ARGS in segment:
                name, _, args = segment.partition(ARGS)
                objs = [{"name": name.strip(), "arguments": args.strip()}]
            else:
                try:
                    obj, _ = decoder.raw_decode(segment)
                except json.JSONDecodeError:
                    return not_called(text)
                objs = obj if isinstance(obj, list) else [obj]
            for o in objs:
                if isinstance(o, dict) and isinstance(o.get("arguments"), str):
                    try:  # the v11 layout's arguments may be followed by other text
                        o = {**o, "arguments": decoder.raw_decode(o["arguments"])[0]}
                    except json.JSONDecodeError:
                        return not_called(text)
                call = parse_call(o, self.id_prefix, ("arguments", "parameters"))
                if call is None:
                    return not_called(text)
                calls.append(call)
        if not calls:
            return not_called(text)
        return ExtractedToolCalls(True, calls, content if content.strip() else None)

    def section_start(self, text: str) -> tuple[int, bool] | None:
        i = text.find(TOOL_CALLS)
        if i >= 0:
            return i, True
        j = partial_marker_start(text, TOOL_CALLS)
        return None if j is None else (j, False)
