"""One generated sequence, split into what the APIs answer: reasoning (when the server has
a `--reasoning-parser`), content, and tool calls (by the request's `ToolPlan`).

Tool calls are read from the answer after the thinking; when the answer holds none and
the thinking does (some models call tools before closing it), those calls count, and
the thinking is what is left around them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.platforms.reasoning import ReasoningDelta, ReasoningParser, ReasoningStream
from tokenmill.platforms.tool_parsing import (
    ContentDelta,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
)
from tokenmill.server.tools import ToolEvents, ToolPlan

OutputEvent = ReasoningDelta | ContentDelta | ToolCallDelta


def reasoning_parser(
    parser: type[ReasoningParser] | None, structured
) -> ReasoningParser | None:
    """The parser to split this request's output with: none when the server has none, or
    when the output is constrained to JSON from its first token (a JSON constraint leaves
    no room for thinking; a regex, choice or grammar may spell it out)."""
    if parser is None:
        return None
    if structured is not None and structured.kind in ("json", "json_object"):
        return None
    return parser()


@dataclass(slots=True)
class SplitOutput:
    reasoning: str | None
    found: ExtractedToolCalls

    @property
    def content(self) -> str | None:
        return self.found.content


def split_output(plan: ToolPlan, parser: ReasoningParser | None, prompt: str, text: str) -> SplitOutput:
    """The reasoning and tool calls of a complete output `text` to `prompt`."""
    if parser is None:
        return SplitOutput(None, plan.extract(text))
    reasoning, answer = parser.extract(prompt, text)
    found = plan.extract(answer)
    if not found.tools_called and reasoning and plan.mode == "auto":
        inner = plan.extract(reasoning)
        if inner.tools_called:
            return SplitOutput(inner.content, ExtractedToolCalls(True, inner.tool_calls,
                                                                 answer or None))
    return SplitOutput(reasoning, found)


@dataclass(slots=True)
class OutputEvents:
    """One streamed sequence: text deltas in, reasoning / content / tool-call events out.

    With no parser it is the plan's own tool events. Calls found inside the thinking go out
    at the end, after the thinking text that held them (already streamed as reasoning).
    """

    plan: ToolPlan
    parser: ReasoningParser | None
    prompt: str
    tools: ToolEvents = field(init=False)
    reasoning: ReasoningStream | None = field(init=False)
    reasoning_text: str = field(default="", init=False)
    extra_called: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.tools = self.plan.stream()
        self.reasoning = None if self.parser is None else self.parser.stream(self.prompt)

    @property
    def called(self) -> bool:
        return self.tools.called or self.extra_called

    def feed(self, delta: str) -> list[OutputEvent]:
        if self.reasoning is None:
            return self.tools.feed(delta)
        return self._route(self.reasoning.feed(delta))

    def finish(self) -> list[OutputEvent]:
        events = [] if self.reasoning is None else self._route(self.reasoning.finish())
        events += self.tools.finish()
        if self.plan.mode == "auto" and not self.tools.called and self.reasoning_text:
            inner = self.plan.extract(self.reasoning_text)
            if inner.tools_called:
                self.extra_called = True
                for i, call in enumerate(inner.tool_calls):
                    events += [ToolCallDelta(i, call.id, call.name, ""),
                               ToolCallDelta(i, arguments=call.arguments)]
        return events

    def _route(self, pieces) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for p in pieces:
            if isinstance(p, ReasoningDelta):
                self.reasoning_text += p.text
                out.append(p)
            else:
                out += self.tools.feed(p.text)
        return out


def calls_of(events: list[OutputEvent]) -> list[ToolCall]:
    """The tool calls a list of events spells out, in index order."""
    parts: dict[int, list] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            entry = parts.setdefault(e.index, [None, None, ""])
            entry[0] = e.id or entry[0]
            entry[1] = e.name or entry[1]
            entry[2] += e.arguments
    return [ToolCall(i, n, a) for _, (i, n, a) in sorted(parts.items())]
