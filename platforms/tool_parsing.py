"""The tool-call parser contract (the `tool_parser` plugin kind) and the streaming wrapper
every parser shares.

A parser turns one model family's tool-call format into tool calls; a plugin offers it
under a name through `tokenmill_tool_parsers() -> {name: ToolParser subclass}` and the
server picks it with `--tool-call-parser NAME`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import ClassVar


def partial_marker_start(text: str, marker: str) -> int | None:
    """The index where a proper prefix of `marker` ends `text`, if one does (a marker a
    streamed output may yet complete)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return None


def new_tool_call_id(prefix: str = "call_") -> str:
    """`call_<24 hex>` (OpenAI) or `toolu_<24 hex>` (Anthropic)."""
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def arguments_dict(self) -> dict:
        return json.loads(self.arguments)


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    """What a parser found in one complete output. With no tool calls, `content` is the
    whole text, unchanged; with some, it is the text around them (None if only blanks)."""

    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


def not_called(text: str) -> ExtractedToolCalls:
    """`text` as plain content: no tool call in it."""
    return ExtractedToolCalls(False, [], text)


def parse_call(obj: object, id_prefix: str, args_keys: tuple[str, ...]) -> ToolCall | None:
    """A ToolCall from `{"name": str, <args key>: object}`, or None if `obj` is not one.
    Arguments given as a JSON string (some models double-encode) are accepted too."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_tool_call_id(id_prefix), obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """Finds tool calls in a model's text output, in one model family's format.

    Subclasses implement `extract_tool_calls` (a complete output) and `section_start`
    (where, in a prefix of an output, the tool-call part begins or may begin). Parsers
    never raise on model output: anything malformed is returned as content.
    """

    # The format's markers are special tokens, so the output must keep them (vLLM's
    # mistral parser needs the same).
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, id_prefix: str = "call_", tools: list[dict] | None = None) -> None:
        """`tools`: the request's HF function tools, for formats whose arguments are text
        that the parameter schemas type (Qwen3-Coder XML)."""
        self.id_prefix = id_prefix
        self.tools = tools or []

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def section_start(self, text: str) -> tuple[int, bool] | None:
        """Where, in `text` (a prefix of an output), a tool-call section begins: (index,
        True) for a whole start marker, (index, False) for what may yet become one (a
        partial marker at the end); None if all of `text` is plain content so far."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One piece of the `index`-th tool call: first its id and name, then its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


StreamEvent = ContentDelta | ToolCallDelta


class ToolCallStream:
    """Streams one output through a parser: content goes out as it comes; from the first
    (possible) tool-call marker on, text is held and parsed when the output ends.

    The concatenated events say exactly what `extract_tool_calls` says of the whole text,
    except that leading content may go out before the end (it is the same text).
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.held = False  # a tool-call section began: nothing more goes out until the end
        self.tool_calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[StreamEvent]:
        self.text += delta
        if self.held:
            return []
        start = self.parser.section_start(self.text)
        end = len(self.text) if start is None else start[0]
        self.held = start is not None and start[1]
        if not self.text[:end].strip():  # blanks alone are no content (yet)
            return []
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return [ContentDelta(out)] if out else []

    def finish(self) -> list[StreamEvent]:
        """Events for the rest of the output, once it has ended."""
        result = self.parser.extract_tool_calls(self.text)
        events: list[StreamEvent] = []
        content = result.content or ""
        if not result.tools_called:
            content = self.text
        sent_text = self.text[:self.sent]
        rest = content[len(sent_text):] if content.startswith(sent_text) else content
        if rest and (self.sent or rest.strip()):
            events.append(ContentDelta(rest))
        self.tool_calls = result.tool_calls
        for i, call in enumerate(result.tool_calls):
            events.append(ToolCallDelta(i, call.id, call.name, ""))
            events.append(ToolCallDelta(i, arguments=call.arguments))
        return events
