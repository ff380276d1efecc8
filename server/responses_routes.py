"""The OpenAI Responses API: `POST /v1/responses` (streamed or not), `GET /v1/responses/{id}`.

A request's conversation is its `instructions`, the stored conversation of its
`previous_response_id` (if any) and its `input` items; it is rendered with the chat
template like a chat completion, decoded under the same tool plan and constraints, and
answered as output items: `reasoning` (with a `--reasoning-parser`), `message`,
`function_call`. Responses with `store` (the default) go to the server's bounded store.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.frontend.outputs import RequestOutput
from tokenmill.platforms.reasoning import ReasoningDelta
from tokenmill.platforms.tool_parsing import ContentDelta, ToolCall, ToolCallDelta
from tokenmill.server.chat import _arguments, render_chat
from tokenmill.server.generation import SeqStream, Started, params_or_400, start
from tokenmill.server.output import OutputEvents, reasoning_parser, split_output
from tokenmill.server.response_store import StoredResponse
from tokenmill.server.responses import OPENAI_ERRORS
from tokenmill.server.responses_models import ResponseObject
from tokenmill.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    NamedFunction,
    ReasoningItem,
    ResponsesRequest,
)
from tokenmill.server.serving import (
    APIError,
    DeltaText,
    ServerState,
    event_stream,
    sse,
    state_of,
    unless_disconnected,
)
from tokenmill.server.tools import ToolPlan, plan_tools, structured_outputs

router = APIRouter()
Message = dict[str, Any]


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# ---- the conversation ----------------------------------------------------------------------
def input_messages(items: str | list) -> list[Message]:
    """Input items as HF chat messages: function calls join the assistant turn they follow
    (or open one), their outputs become `tool` messages, reasoning goes with the next
    assistant turn as `reasoning_content`."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[Message] = []
    reasoning = ""
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning += item.text()
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            msg: Message = {"role": role, "content": item.text()}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, ""
            out.append(msg)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": _arguments(item.arguments, f"input.{i}")}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            if reasoning:
                last["reasoning_content"], reasoning = reasoning, ""
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def _output_message(items: list[dict[str, Any]]) -> Message:
    """The assistant turn that output `items` are, for the next turn's conversation."""
    msg: Message = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "reasoning":
            msg["reasoning_content"] = "".join(c["text"] for c in item["content"])
        elif item["type"] == "message":
            msg["content"] += "".join(c["text"] for c in item["content"])
        elif item["type"] == "function_call":
            msg.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"],
                             "arguments": _arguments(item["arguments"], "output")}})
    return msg


def _history(state: ServerState, body: ResponsesRequest) -> list[Message]:
    if body.previous_response_id is None:
        return []
    stored = state.responses.get(body.previous_response_id)
    if stored is None:
        raise APIError(404, f"Response with id {body.previous_response_id!r} not found; it was "
                       "never stored (store=false), or it was evicted from the server's store",
                       "previous_response_id", "previous_response_not_found")
    return [dict(m) for m in stored.conversation]


# ---- output items --------------------------------------------------------------------------
def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def _items(reasoning: str | None, content: str | None, calls: list[ToolCall],
           status: str) -> list[dict[str, Any]]:
    items = []
    if reasoning is not None:
        items.append(_reasoning_item(_id("rs"), reasoning, status))
    if content or not (calls or reasoning):
        items.append(_message_item(_id("msg"), content or "", status))
    items += [_call_item(_id("fc"), c, status) for c in calls]
    return items


# ---- the response object -------------------------------------------------------------------
def _tools_echo(body: ResponsesRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t.name, "description": t.description,
             "parameters": t.parameters or {"type": "object", "properties": {}},
             "strict": t.strict} for t in body.tools or []]


def _skeleton(body: ResponsesRequest, response_id: str, model: str, created: float) -> dict:
    choice = body.tool_choice
    fmt = body.text.format if body.text and body.text.format else None
    return {
        "id": response_id, "object": "response", "created_at": created, "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "model": model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning and body.reasoning.effort, "summary": None},
        "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                 else {"type": "text"}},
        "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction)
        else (choice or ("auto" if body.tools else "none")),
        "tools": _tools_echo(body), "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled", "usage": None, "user": body.user,
    }


def _usage(final: RequestOutput, num_reasoning: int) -> dict[str, Any]:
    num_in, num_out = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
    return {"input_tokens": num_in,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": num_out,
            "output_tokens_details": {"reasoning_tokens": num_reasoning},
            "total_tokens": num_in + num_out}


async def _finish(state: ServerState, response: dict, items: list[dict], final: RequestOutput,
                  conversation: list[Message]) -> dict:
    """Complete `response` with its output and usage, and store it if asked to."""
    length = final.outputs[0].finish_reason == "length"
    reasoning = "".join(c["text"] for i in items if i["type"] == "reasoning" for c in i["content"])
    num_reasoning = len(await state.run_render(
        partial(state.engine.tokenizer.encode, reasoning, add_special_tokens=False),
        "tokenizing the reasoning", timed=False)) if reasoning else 0
    response.update(
        status="incomplete" if length else "completed", output=items,
        incomplete_details={"reason": "max_output_tokens"} if length else None,
        completed_at=time.time(), usage=_usage(final, num_reasoning),
    )
    if response["store"]:
        state.responses.put(response["id"], StoredResponse(
            response, [*conversation, _output_message(items)]))
    return response


# ---- POST /v1/responses ----------------------------------------------------------------------
def _plan(body: ResponsesRequest, state: ServerState) -> ToolPlan:
    tools = [{"type": "function", "function": {
        "name": t.name, "description": t.description or "",
        "parameters": t.parameters or {"type": "object", "properties": {}}}}
        for t in body.tools or []] or None
    choice = body.tool_choice
    named = choice.name if isinstance(choice, NamedFunction) else None
    return plan_tools(tools, "named" if named else choice, state.tools, named=named,
                      single=body.parallel_tool_calls is False)


@router.post(
    "/v1/responses",
    response_model=None,
    responses={200: {"model": ResponseObject}, **OPENAI_ERRORS},
)
async def create_response(body: ResponsesRequest, request: Request):
    state = state_of(request)
    model = state.check_model(body.model)
    state.check_room()
    conversation = [*_history(state, body), *input_messages(body.input)]
    prompt_messages = conversation
    if body.instructions:
        prompt_messages = [{"role": "system", "content": body.instructions}, *conversation]
    plan = _plan(body, state)
    fmt = body.text.format if body.text else None
    structured = structured_outputs(plan, fmt and fmt.type, fmt and fmt.schema_, "text.format",
                                    compact=state.compact_json, closed=bool(fmt and fmt.strict))
    if structured is not None and plan.mode == "auto":  # JSON was asked for, not tool calls
        plan = ToolPlan("none", plan.tools)
    effort = body.reasoning.effort if body.reasoning else None
    text, ids = await render_chat(state, prompt_messages, tools=plan.tools,
                                  template_kwargs={"reasoning_effort": effort} if effort else None)
    max_tokens = body.max_output_tokens or max(state.engine.max_model_len - len(ids), 1)
    params = params_or_400(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, seed=body.seed,
        stop=body.stop, structured_outputs=structured,
        skip_special_tokens=not plan.keeps_special_tokens,
    )
    response_id = _id("resp")
    started = await start(request, state.engine, [(text, ids)], params, response_id,
                          body.cache_salt,
                          error_param="tools" if plan.schema() else "text.format")
    response = _skeleton(body, response_id, model, time.time())
    parser = reasoning_parser(state.reasoning_parser, structured)
    if body.stream:
        events = _Events(started, response, params.max_stop_len(),
                         OutputEvents(plan, parser, text), state, conversation)
        return event_stream(events.run(), request)
    (final,) = await unless_disconnected(request, started.finals())
    out = final.outputs[0]
    split = split_output(plan, parser, text, out.text)
    status = "incomplete" if out.finish_reason == "length" else "completed"
    items = _items(split.reasoning, split.content, split.found.tool_calls, status)
    return JSONResponse(await _finish(state, response, items, final, conversation))


@router.get(
    "/v1/responses/{response_id}",
    response_model=ResponseObject,
    responses=OPENAI_ERRORS,
)
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    stored = state_of(request).responses.get(response_id)
    if stored is None:
        raise APIError(404, f"Response with id {response_id!r} not found; it was never stored "
                       "(store=false), or it was evicted from the server's store",
                       "response_id", "response_not_found")
    return stored.response


# ---- streaming -----------------------------------------------------------------------------
class _Events:
    """The event sequence of one streamed response: `response.created`, `.in_progress`,
    then per output item `output_item.added`, its content part and deltas, their `.done`
    events and `output_item.done`; last `response.completed` (or `.incomplete`)."""

    def __init__(self, started: Started, response: dict, max_stop_len: int,
                 outputs: OutputEvents, state: ServerState, conversation: list[Message]) -> None:
        self.started, self.response, self.outputs = started, response, outputs
        self.state, self.conversation = state, conversation
        self.stream = SeqStream(DeltaText(max_stop_len))
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""  # its text (or arguments) so far

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, kind)

    def _part(self, item: dict[str, Any]) -> dict[str, Any]:
        """The content part of a reasoning or message item, with the text so far."""
        if item["type"] == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close("completed")
        self.open, self.text = item, ""
        index = len(self.items)
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        if item["type"] != "function_call":
            out.append(self._event("response.content_part.added", output_index=index,
                                   item_id=item["id"], content_index=0, part=self._part(item)))
        return out

    def _close(self, status: str) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, ref = len(self.items), {"item_id": item["id"], "output_index": len(self.items)}
        out = []
        if item["type"] == "function_call":
            item = {**item, "arguments": self.text, "status": status}
            out.append(self._event("response.function_call_arguments.done", **ref,
                                   arguments=self.text))
        else:
            part = self._part(item)
            done = ("response.reasoning_text.done" if item["type"] == "reasoning"
                    else "response.output_text.done")
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            out.append(self._event(done, **ref, content_index=0, text=self.text, **extra))
            out.append(self._event("response.content_part.done", **ref, content_index=0,
                                   part=part))
            item = {**item, "content": [part], "status": status}
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        return out

    def _on(self, event) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(event, ReasoningDelta):
            if self.open is None or self.open["type"] != "reasoning":
                out += self._open({"id": _id("rs"), "type": "reasoning", "summary": [],
                                   "content": [], "status": "in_progress"})
            kind = "response.reasoning_text.delta"
        elif isinstance(event, ContentDelta):
            if self.open is None or self.open["type"] != "message":
                out += self._open({"id": _id("msg"), "type": "message", "role": "assistant",
                                   "content": [], "status": "in_progress"})
            kind = "response.output_text.delta"
        else:
            assert isinstance(event, ToolCallDelta)
            if event.name is not None:
                out += self._open({"id": _id("fc"), "type": "function_call", "call_id": event.id,
                                   "name": event.name, "arguments": "", "status": "in_progress"})
            if not event.arguments:
                return out
            self.text += event.arguments
            return out + [self._event("response.function_call_arguments.delta",
                                      item_id=self.open["id"], output_index=len(self.items),
                                      delta=event.arguments)]
        self.text += event.text
        ref = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
        extra = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return out + [self._event(kind, **ref, delta=event.text, **extra)]

    async def run(self) -> AsyncIterator[bytes]:
        yield self._event("response.created", response=dict(self.response))
        yield self._event("response.in_progress", response=dict(self.response))
        final = self.started.firsts[0]
        async for _, out in self.started.merged():
            final = out
            step = self.stream.advance(out.outputs[0])
            if step is None:
                continue
            events = self.outputs.feed(step[0]) if step[0] else []
            if self.stream.done:
                events += self.outputs.finish()
            for event in events:
                for line in self._on(event):
                    yield line
        status = "incomplete" if final.outputs[0].finish_reason == "length" else "completed"
        if not self.items and self.open is None:  # nothing at all was said
            for line in self._open({"id": _id("msg"), "type": "message", "role": "assistant",
                                    "content": [], "status": "in_progress"}):
                yield line
        for line in self._close(status):
            yield line
        response = await _finish(self.state, self.response, self.items, final, self.conversation)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self._event(kind, response=response)
