"""How a request uses tools: which tool choice, the schema that forces a call, and how the
output turns back into tool calls (whole, or as stream events).

| choice | prompt | decoding | output |
|---|---|---|---|
| none | tools rendered | free | text, never parsed |
| auto | tools rendered | free | parsed by the server's `--tool-call-parser` |
| named (OpenAI function / Anthropic `tool`) | tools rendered | JSON schema = the function's parameters | the output is the arguments |
| required (OpenAI) / `any` (Anthropic) | tools rendered | `{"name", "arguments"}`, anyOf over the tools | one call |

Tools stay in the prompt under `none` so that an agent turn that stops calling tools
still extends the previous turn's prompt (prefix-cache hits).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.platforms.tool_parsing import (
    ContentDelta,
    ExtractedToolCalls,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    new_tool_call_id,
    not_called,
    parse_call,
)
from tokenmill.server.closed_schema import close_objects
from tokenmill.server.serving import APIError, ToolConfig
from tokenmill.structured import StructuredOutputsParams

Mode = Literal["none", "auto", "named", "required"]
_EMPTY_PARAMS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: Mode = "none"
    tools: list[dict[str, Any]] | None = None  # HF function tools, for the chat template
    named: str | None = None  # the forced function
    parser: type[ToolParser] | None = None  # auto: the server's --tool-call-parser
    single: bool = False  # keep only the first call
    id_prefix: str = "call_"

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow, for named and required choices: the
        tools' parameters with their objects closed (server/closed_schema.py)."""
        fns = {t["function"]["name"]: t["function"] for t in self.tools or []}
        if self.mode == "named":
            return close_objects(fns[self.named].get("parameters") or _EMPTY_PARAMS)
        if self.mode == "required":
            return {"anyOf": [
                {"type": "object",
                 "properties": {"name": {"const": name},
                                "arguments": close_objects(fn.get("parameters") or _EMPTY_PARAMS)},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for name, fn in fns.items()
            ]}
        return None

    def extract(self, text: str) -> ExtractedToolCalls:
        """The tool calls of a complete output; malformed output is all content."""
        if self.mode == "auto":
            found = self.parser(self.id_prefix, self.tools).extract_tool_calls(text)
        elif self.mode == "named":
            found = _named_call(text, self.named, self.id_prefix)
        elif self.mode == "required":
            found = _required_calls(text, self.id_prefix)
        else:
            found = not_called(text)
        if self.single and len(found.tool_calls) > 1:
            found = ExtractedToolCalls(True, found.tool_calls[:1], found.content)
        return found

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output must keep special tokens for the parser to see its markers."""
        return self.mode == "auto" and self.parser.keeps_special_tokens

    def stream(self) -> ToolEvents:
        if self.mode == "auto":
            return _ParserEvents(ToolCallStream(self.parser(self.id_prefix, self.tools)),
                                 self.single)
        if self.mode == "named":
            return _NamedEvents(self.named, self.id_prefix)
        if self.mode == "required":
            return _WholeEvents(self)
        return ToolEvents()


def plan_tools(
    tools: list[dict[str, Any]] | None,
    choice: str | None,
    config: ToolConfig,
    *,
    named: str | None = None,
    single: bool = False,
    id_prefix: str = "call_",
    param: str = "tool_choice",
) -> ToolPlan:
    """The plan for `choice` ("none", "auto", "required", "named" with `named`, or None:
    auto with tools, none without). A choice the request or server cannot honour is a 400."""
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice in ("required", "named"):
            raise APIError(400, f"tool_choice {named or choice!r} needs `tools`", param)
        return ToolPlan(id_prefix=id_prefix)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tool names must be unique, got {names}", "tools")
    if choice == "named" and named not in names:
        raise APIError(400, f"tool_choice names {named!r}, which is not among the tools {names}",
                       param)
    if choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise APIError(
            400,
            '"auto" tool choice is off on this server (--no-enable-auto-tool-choice); use '
            'tool_choice "none", "required" or a named tool instead',
            param,
        )
    return ToolPlan(choice, tools, named if choice == "named" else None,
                    config.tool_call_parser if choice == "auto" else None, single, id_prefix)


def _named_call(text: str, name: str, id_prefix: str) -> ExtractedToolCalls:
    try:
        args = json.loads(text)
    except json.JSONDecodeError:
        return not_called(text)
    if not isinstance(args, dict):
        return not_called(text)
    return ExtractedToolCalls(True, [ToolCall(new_tool_call_id(id_prefix), name, text.strip())])


def _required_calls(text: str, id_prefix: str) -> ExtractedToolCalls:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return not_called(text)
    objs = obj if isinstance(obj, list) else [obj]
    calls = [parse_call(o, id_prefix, ("arguments",)) for o in objs]
    if not calls or any(c is None for c in calls):
        return not_called(text)
    return ExtractedToolCalls(True, calls)


# ---- streaming ----------------------------------------------------------------------------
class ToolEvents:
    """One streamed sequence's text deltas in, content and tool-call events out."""

    def __init__(self) -> None:
        self.called = False  # some tool call went out

    def feed(self, delta: str) -> list[StreamEvent]:
        return [ContentDelta(delta)] if delta else []

    def finish(self) -> list[StreamEvent]:
        return []


class _ParserEvents(ToolEvents):
    def __init__(self, stream: ToolCallStream, single: bool) -> None:
        super().__init__()
        self.inner, self.single = stream, single

    def feed(self, delta: str) -> list[StreamEvent]:
        return self.inner.feed(delta)

    def finish(self) -> list[StreamEvent]:
        events = self.inner.finish()
        if self.single:
            events = [e for e in events if not isinstance(e, ToolCallDelta) or e.index == 0]
        self.called = any(isinstance(e, ToolCallDelta) for e in events)
        return events


class _NamedEvents(ToolEvents):
    """The output is the arguments: they stream as they come, after the call's name."""

    def __init__(self, name: str, id_prefix: str) -> None:
        super().__init__()
        self.name, self.id_prefix = name, id_prefix

    def feed(self, delta: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if not self.called:
            self.called = True
            events.append(ToolCallDelta(0, new_tool_call_id(self.id_prefix), self.name, ""))
        if delta:
            events.append(ToolCallDelta(0, arguments=delta))
        return events

    def finish(self) -> list[StreamEvent]:
        return [] if self.called else self.feed("")


class _WholeEvents(ToolEvents):
    """Held to the end, then parsed whole."""

    def __init__(self, plan: ToolPlan) -> None:
        super().__init__()
        self.plan, self.text = plan, ""

    def feed(self, delta: str) -> list[StreamEvent]:
        self.text += delta
        return []

    def finish(self) -> list[StreamEvent]:
        found = self.plan.extract(self.text)
        if not found.tools_called:
            return [ContentDelta(self.text)] if self.text else []
        self.called = True
        events: list[StreamEvent] = [ContentDelta(found.content)] if found.content else []
        for i, call in enumerate(found.tool_calls):
            events += [ToolCallDelta(i, call.id, call.name, ""), ToolCallDelta(i, arguments=call.arguments)]
        return events


def structured_outputs(
    plan: ToolPlan,
    kind: str | None = None,
    schema: dict[str, Any] | None = None,
    param: str = "response_format",
    extra: dict[str, Any] | None = None,
    compact: bool = False,
    closed: bool = False,
):
    """`StructuredOutputsParams` forcing the plan's schema, the requested output format
    (`kind` "text", "json_object" or "json_schema" with `schema`, named by `param`) or
    vLLM's `structured_outputs` extra (`extra`, its fields as given); None when decoding
    is free. More than one of them is a 400. `compact`: the JSON of the first two has no
    optional whitespace (the server's --structured-outputs-disable-any-whitespace), else a
    bounded amount. `closed`: the format's schema is strict (its objects are closed, as
    the plan's tool schemas always are)."""
    forced = plan.schema()
    asked = [name for name, on in (("tool_choice", forced is not None),
                                   (param, kind not in (None, "text")),
                                   ("structured_outputs", extra is not None)) if on]
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)} cannot be combined: each constrains the "
                       "whole output", asked[-1])
    kw: dict[str, Any] | None = None
    if forced is not None:
        kw, param = {"json": forced, "disable_any_whitespace": compact}, "tools"
    elif kind == "json_object":
        kw = {"json_object": True, "disable_any_whitespace": compact}
    elif kind == "json_schema":
        if schema is None:
            raise APIError(400, f"{param}: json_schema needs a schema", param)
        kw = {"json": close_objects(schema) if closed else schema,
              "disable_any_whitespace": compact}
    elif extra is not None:
        kw, param = extra, "structured_outputs"
    if kw is None:
        return None
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:  # StructuredOutputError included: a bad schema
        raise APIError(400, f"invalid {param}: {e}", param) from e
