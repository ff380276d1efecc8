"""Anthropic-compatible routes: /v1/messages (streaming included) and its count_tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.server.generation import SeqStream, Started, params_or_400, start
from tokenmill.server.protocol import CountTokensRequest, MessagesRequest
from tokenmill.server.responses import ANTHROPIC_ERRORS, CountTokensResponse, MessageResponse
from tokenmill.server.serving import (
    APIError,
    DeltaText,
    event_stream,
    sse,
    state_of,
    unless_disconnected,
)

router = APIRouter()


def _stop(out: CompletionOutput) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished sequence."""
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


async def _render(request: Request, body) -> tuple[str, list[int]]:
    try:
        return await state_of(request).engine.render_chat(body.chat_messages())
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e


@router.post(
    "/v1/messages/count_tokens", response_model=CountTokensResponse, responses=ANTHROPIC_ERRORS
)
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    state_of(request).check_model(body.model)
    _, ids = await _render(request, body)
    return {"input_tokens": len(ids)}


@router.post(
    "/v1/messages",
    response_model=None,
    responses={200: {"model": MessageResponse}, **ANTHROPIC_ERRORS},
)
async def create_message(body: MessagesRequest, request: Request):
    state = state_of(request)
    model = state.check_model(body.model)
    text, ids = await _render(request, body)
    params = params_or_400(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences,
    )
    rid = state.engine.new_request_id("msg")
    started = await start(request, state.engine, [(text, ids)], params, rid)
    head = {"id": rid, "type": "message", "role": "assistant", "model": model}
    if body.stream:
        return event_stream(_stream(started, head, params.max_stop_len()), request.url.path)
    (final,) = await unless_disconnected(request, started.finals())
    out = final.outputs[0]
    stop_reason, stop_sequence = _stop(out)
    return JSONResponse({
        **head,
        "content": [{"type": "text", "text": out.text}],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(final),
    })


async def _stream(started: Started, head: dict[str, Any], max_stop_len: int) -> AsyncIterator[str]:
    first = started.firsts[0]
    usage = {**_usage(first), "output_tokens": 0}
    message = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield sse({"type": "message_start", "message": message}, "message_start")
    yield sse({"type": "content_block_start", "index": 0,
               "content_block": {"type": "text", "text": ""}}, "content_block_start")
    yield sse({"type": "ping"}, "ping")
    stream = SeqStream(DeltaText(max_stop_len))
    final = first
    async for _, out in started.merged():
        final = out
        step = stream.advance(out.outputs[0])
        if step is not None and step[0]:
            yield sse({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "text_delta", "text": step[0]}}, "content_block_delta")
    yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
    stop_reason, stop_sequence = _stop(final.outputs[0])
    yield sse({
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": {"output_tokens": len(final.outputs[0].token_ids)},
    }, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
