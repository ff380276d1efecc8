"""Anthropic-compatible routes: /v1/messages (streaming included) and its count_tokens."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.frontend.outputs import CompletionOutput, RequestOutput
from tokenmill.platforms.reasoning import ReasoningDelta
from tokenmill.platforms.tool_parsing import ContentDelta
from tokenmill.server.chat import anthropic_messages, anthropic_tools, render_chat
from tokenmill.server.context_edits import clear_thinking, clear_tool_uses, tool_uses_trigger
from tokenmill.server.generation import SeqStream, Started, params_or_400, start
from tokenmill.server.output import OutputEvent, OutputEvents, reasoning_parser, split_output
from tokenmill.server.protocol import (
    AnthropicClearThinking,
    AnthropicClearToolUses,
    CountTokensRequest,
    MessagesRequest,
)
from tokenmill.server.responses import ANTHROPIC_ERRORS, CountTokensResponse, MessageResponse
from tokenmill.server.serving import DeltaText, event_stream, sse, state_of, unless_disconnected
from tokenmill.server.tools import ToolPlan, plan_tools, structured_outputs

router = APIRouter()


def _stop(out: CompletionOutput, tools_called: bool = False) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished sequence."""
    if tools_called and out.finish_reason == "stop":
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def _usage(out: RequestOutput) -> dict[str, int]:
    return {
        "input_tokens": len(out.prompt_token_ids) - out.num_cached_tokens,
        "cache_read_input_tokens": out.num_cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": len(out.outputs[0].token_ids),
    }


def _plan(body, state) -> ToolPlan:
    choice = body.tool_choice
    kind = None if choice is None else _CHOICES[choice.type]
    return plan_tools(
        anthropic_tools(body), kind, state.tools,
        named=getattr(choice, "name", None),
        single=bool(getattr(choice, "disable_parallel_tool_use", False)),
        id_prefix="toolu_",
    )


_CHOICES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}


def _template_kwargs(body, thinking: bool | None) -> dict[str, Any]:
    """What the chat template is told: `enable_thinking` (Qwen3-style templates) when
    `thinking` is given, `reasoning_effort` from `output_config.effort`."""
    kw: dict[str, Any] = {}
    if thinking is not None:
        kw["enable_thinking"] = thinking
    if body.output_config is not None and body.output_config.effort is not None:
        kw["reasoning_effort"] = body.output_config.effort
    return kw


@router.post(
    "/v1/messages/count_tokens", response_model=CountTokensResponse, responses=ANTHROPIC_ERRORS
)
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    state = state_of(request)
    state.check_model(body.model)
    thinking = None if body.thinking is None else body.thinking.type != "disabled"
    _, ids, _ = await _render_managed(state, body, anthropic_tools(body), thinking)
    return {"input_tokens": len(ids)}


@router.post(
    "/v1/messages",
    response_model=None,
    responses={200: {"model": MessageResponse}, **ANTHROPIC_ERRORS},
)
async def create_message(body: MessagesRequest, request: Request):
    state = state_of(request)
    model = state.check_model(body.model)
    state.check_room()
    plan = _plan(body, state)
    fmt = body.output_config.format if body.output_config else None
    structured = structured_outputs(plan, fmt and fmt.type, fmt and fmt.schema_,
                                    "output_config.format", compact=state.compact_json,
                                    closed=True)  # Anthropic's formats are strict
    thinking = None if body.thinking is None else body.thinking.type != "disabled"
    text, ids, applied = await _render_managed(state, body, plan.tools, thinking)
    params = params_or_400(
        # a cap, as Anthropic's API reads it: Claude Code asks 32,000 of any model
        max_tokens=max(min(body.max_tokens, state.engine.max_model_len - len(ids)), 1),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences,
        structured_outputs=structured,
        skip_special_tokens=not plan.keeps_special_tokens,
    )
    rid = f"msg_{secrets.token_hex(12)}"
    session_id = body.metadata.user_id if body.metadata else None
    started = await start(request, state.engine, [(text, ids)], params, rid,
                          error_param="tools" if plan.schema() else "output_config.format",
                          session_id=session_id)
    head = {"id": rid, "type": "message", "role": "assistant", "model": model}
    parser = reasoning_parser(None if thinking is False else state.reasoning_parser, structured)
    # display "omitted": thinking blocks come back empty (the model still thinks)
    omit = getattr(body.thinking, "display", None) == "omitted"
    if body.stream:
        events = OutputEvents(plan, parser, text)
        hint = (lambda: state.engine.hint_session(session_id)) if session_id else None
        if body.context_management is not None:
            head = {**head, "context_management": {"applied_edits": applied}}
        return event_stream(_stream(started, head, params.max_stop_len(), events, omit, hint),
                            request)
    (final,) = await unless_disconnected(request, started.finals())
    out = final.outputs[0]
    split = split_output(plan, parser, text, out.text)
    found = split.found
    content: list[dict[str, Any]] = []
    if split.reasoning is not None:
        content.append({"type": "thinking", "thinking": "" if omit else split.reasoning,
                        "signature": ""})
    if not found.tools_called or found.content:
        content.append({"type": "text", "text": found.content or ""})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments_dict()}
                for c in found.tool_calls]
    stop_reason, stop_sequence = _stop(out, found.tools_called)
    if found.tools_called and session_id:
        state.engine.hint_session(session_id)
    answer = {**head, "content": content, "stop_reason": stop_reason,
              "stop_sequence": stop_sequence, "usage": _usage(final)}
    if body.context_management is not None:
        answer["context_management"] = {"applied_edits": applied}
    return JSONResponse(answer)


async def _render_managed(state, body, tools: list[dict[str, Any]] | None,
                          thinking: bool | None):
    """(prompt text, ids, applied context edits): the conversation rendered after
    `context_management`'s edits (clearing tool results once the prompt passes the
    edit's trigger, which takes a second render)."""
    conv = anthropic_messages(body)
    kwargs = _template_kwargs(body, thinking)
    edits = body.context_management.edits if body.context_management else []
    applied = [a for e in edits if isinstance(e, AnthropicClearThinking)
               and (a := clear_thinking(conv, e)) is not None]
    text, ids = await render_chat(state, conv, tools=tools, template_kwargs=kwargs)
    for edit in edits:
        if isinstance(edit, AnthropicClearToolUses) and len(ids) >= tool_uses_trigger(edit):
            done = clear_tool_uses(conv, edit)
            if done is not None:
                applied.append(done)
                text, ids = await render_chat(state, conv, tools=tools,
                                              template_kwargs=kwargs)
    return text, ids, applied


class _Blocks:
    """Anthropic content blocks of a stream: opened as events need them, closed in turn."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.omit_thinking = omit_thinking
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or "tool_use"

    def start(self, block: dict[str, Any]) -> list[bytes]:
        events = self.stop()
        self.index += 1
        self.open = block["type"]
        events.append(sse({"type": "content_block_start", "index": self.index,
                           "content_block": block}, "content_block_start"))
        return events

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def events(self, event: OutputEvent) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(event, ReasoningDelta):
            if self.open != "thinking":
                out += self.start({"type": "thinking", "thinking": "", "signature": ""})
            if self.omit_thinking:
                return out
            delta = {"type": "thinking_delta", "thinking": event.text}
        elif isinstance(event, ContentDelta):
            if self.open != "text":
                out += self.start({"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": event.text}
        else:
            if event.name is not None:
                out += self.start({"type": "tool_use", "id": event.id, "name": event.name,
                                   "input": {}})
            if not event.arguments:
                return out
            delta = {"type": "input_json_delta", "partial_json": event.arguments}
        out.append(sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                       "content_block_delta"))
        return out


async def _stream(
    started: Started, head: dict[str, Any], max_stop_len: int, tool_events: OutputEvents,
    omit_thinking: bool = False, on_tool_call: Callable[[], None] | None = None,
) -> AsyncIterator[bytes]:
    first = started.firsts[0]
    usage = {**_usage(first), "output_tokens": 0}
    message = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield sse({"type": "message_start", "message": message}, "message_start")
    blocks = _Blocks(omit_thinking)
    if tool_events.plan.mode == "none" and tool_events.parser is None:
        # plain text: the text block opens at once, as before tools
        for event in blocks.start({"type": "text", "text": ""}):
            yield event
    yield sse({"type": "ping"}, "ping")
    stream = SeqStream(DeltaText(max_stop_len))
    final = first
    async for _, out in started.merged():
        final = out
        step = stream.advance(out.outputs[0])
        if step is None:
            continue
        events = tool_events.feed(step[0]) if step[0] else []
        if stream.done:
            events += tool_events.finish()
        for event in events:
            for line in blocks.events(event):
                yield line
    if blocks.index < 0:  # nothing at all was said
        for event in blocks.start({"type": "text", "text": ""}):
            yield event
    for event in blocks.stop():
        yield event
    stop_reason, stop_sequence = _stop(final.outputs[0], tool_events.called)
    if tool_events.called and on_tool_call is not None:
        on_tool_call()  # the session will be back (KV offload prefetches its next turn)
    yield sse({
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": {"output_tokens": len(final.outputs[0].token_ids)},
    }, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
