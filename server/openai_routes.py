"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.frontend.outputs import CompletionOutput, RequestOutput
from tokenmill.platforms.reasoning import ReasoningDelta
from tokenmill.platforms.tool_parsing import ContentDelta, ToolCall
from tokenmill.server.chat import openai_messages, openai_tools, render_chat
from tokenmill.server.generation import SeqStream, Started, params_or_400, start
from tokenmill.server.output import OutputEvent, OutputEvents, reasoning_parser, split_output
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from tokenmill.server.responses import (
    OPENAI_ERRORS,
    ChatCompletionResponse,
    CompletionResponse,
    ModelList,
)
from tokenmill.server.serving import (
    APIError,
    DeltaText,
    ServerState,
    event_stream,
    sse,
    state_of,
    unless_disconnected,
    usage_dict,
)
from tokenmill.server.tools import ToolPlan, plan_tools, structured_outputs

router = APIRouter()

_MIN_LOGPROB = -9999.0  # JSON has no -inf
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits only: "²".isdigit(), and int() refuses it


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def _logit_bias(state: ServerState, bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as strings) checked against the vocabulary."""
    if not bias:
        return None
    size, out = len(state.engine.tokenizer), {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key) or not 0 <= int(key) < size:
            raise APIError(400, f"logit_bias: {key!r} is not a token id in the vocabulary "
                           f"[0, {size})", "logit_bias")
        out[int(key)] = value
    return out


def _sampling(state: ServerState, body, max_tokens: int, logprobs: int | None, structured=None,
              skip_special_tokens: bool = True):
    return params_or_400(
        structured_outputs=structured,
        logit_bias=_logit_bias(state, body.logit_bias),
        n=body.n,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens and skip_special_tokens,
    )


def _usage(finals: list[RequestOutput]) -> dict[str, Any]:
    return usage_dict(
        sum(len(f.prompt_token_ids) for f in finals),
        sum(len(o.token_ids) for f in finals for o in f.outputs),
        sum(f.num_cached_tokens for f in finals),
    )


def _streams(started: Started, max_stop_len: int) -> dict[tuple[int, int], SeqStream]:
    return {
        (i, o.index): SeqStream(DeltaText(max_stop_len))
        for i, first in enumerate(started.firsts)
        for o in first.outputs
    }


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


# ---- /v1/models ------------------------------------------------------------------------------
@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "tokenmill",
                "max_model_len": state.engine.max_model_len,
            }
            for name in state.model_names
        ],
    }


# ---- /v1/completions -------------------------------------------------------------------------
def _completion_logprobs(out: CompletionOutput, lo: int, hi: int, k: int, offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, pos in zip(out.token_ids[lo:hi], (out.logprobs or [])[lo:hi]):
        chosen = pos[tid]
        tokens.append(chosen.decoded_token or "")
        token_lps.append(_lp(chosen.logprob))
        tops.append({
            (lp.decoded_token or ""): _lp(lp.logprob)
            for lp in sorted(pos.values(), key=lambda lp: lp.rank or 0)
            if lp.rank is not None and lp.rank <= max(k, 1)
        })
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def _encode_prompts(state: ServerState, prompt) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    encoded = []
    for p in prompt:
        if isinstance(p, str):
            ids = await state.run_render(partial(state.engine.tokenizer.encode, p),
                                         "tokenizing the prompt", "prompt", timed=False)
            encoded.append((p, ids))
        else:
            encoded.append((None, list(p)))
    return encoded


@router.post(
    "/v1/completions",
    response_model=None,
    responses={200: {"model": CompletionResponse}, **OPENAI_ERRORS},
)
async def create_completion(body: CompletionRequest, request: Request):
    state = state_of(request)
    model = state.check_model(body.model)
    state.check_room()
    if body.echo:
        raise APIError(400, "echo=true is not supported", param="echo")
    prompts = await _encode_prompts(state, body.prompt)
    structured = structured_outputs(ToolPlan(), extra=body.structured_outputs_dict())
    params = _sampling(state, body, body.max_tokens or 16, body.logprobs, structured)
    rid = state.engine.new_request_id("cmpl")
    started = await start(request, state.engine, prompts, params, rid, body.cache_salt,
                          error_param="structured_outputs",
                          session_id=body.session_id or body.user)
    n, created = body.n, int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}

    if body.stream:
        return event_stream(
            _stream_completion(started, head, n, body.logprobs, params.max_stop_len(),
                               _include_usage(body)),
            request,
        )
    finals = await unless_disconnected(request, started.finals())
    choices = []
    for i, final in enumerate(finals):
        for o in final.outputs:
            lps = None
            if body.logprobs is not None:
                lps = _completion_logprobs(o, 0, len(o.token_ids), body.logprobs, 0)
            choices.append({
                "index": i * n + o.index, "text": o.text, "logprobs": lps,
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
            })
    return JSONResponse({**head, "choices": choices, "usage": _usage(finals)})


async def _stream_completion(
    started: Started, head: dict, n: int, logprobs: int | None, max_stop_len: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    streams = _streams(started, max_stop_len)
    finals: dict[int, RequestOutput] = {}
    async for i, out in started.merged():
        for o in out.outputs:
            s = streams[(i, o.index)]
            offset = s.text.sent
            step = s.advance(o)
            if step is None:
                continue
            text, lo, hi = step
            lps = None if logprobs is None else _completion_logprobs(o, lo, hi, logprobs, offset)
            choice = {
                "index": i * n + o.index, "text": text, "logprobs": lps,
                "finish_reason": o.finish_reason if s.done else None,
                "stop_reason": o.stop_reason if s.done else None,
            }
            yield sse({**head, "choices": [choice]})
        if out.finished:
            finals[i] = out
    if include_usage:
        yield sse({**head, "choices": [], "usage": _usage(list(finals.values()))})
    yield sse("[DONE]")


# ---- /v1/chat/completions --------------------------------------------------------------------
def _chat_logprobs(out: CompletionOutput, lo: int, hi: int, k: int) -> dict[str, Any]:
    def entry(lp) -> dict[str, Any]:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": _lp(lp.logprob), "bytes": list(token.encode())}

    content = []
    for tid, pos in zip(out.token_ids[lo:hi], (out.logprobs or [])[lo:hi]):
        top = sorted((lp for lp in pos.values() if lp.rank is not None and lp.rank <= k),
                     key=lambda lp: lp.rank)
        content.append({**entry(pos[tid]), "top_logprobs": [entry(lp) for lp in top]})
    return {"content": content}


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={200: {"model": ChatCompletionResponse}, **OPENAI_ERRORS},
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    state = state_of(request)
    model = state.check_model(body.model)
    state.check_room()
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    choice = body.tool_choice
    plan = plan_tools(
        openai_tools(body),
        "named" if isinstance(choice, NamedToolChoice) else choice,
        state.tools,
        named=choice.function.name if isinstance(choice, NamedToolChoice) else None,
        single=body.parallel_tool_calls is False,
    )
    fmt = body.response_format
    structured = structured_outputs(
        plan, fmt and fmt.type, fmt and fmt.json_schema and fmt.json_schema.schema_,
        extra=body.structured_outputs_dict(), compact=state.compact_json,
        closed=bool(fmt and fmt.json_schema and fmt.json_schema.strict),
    )
    if structured is not None and plan.mode == "auto":  # JSON was asked for, not tool calls
        plan = ToolPlan("none", plan.tools)
    if body.chat_template is not None and not state.trust_request_chat_template:
        raise APIError(400, "this server renders prompts with its own chat template only; a "
                       "request's `chat_template` is code, accepted only when the server runs "
                       "with --trust-request-chat-template", param="chat_template")
    text, ids = await render_chat(state, openai_messages(body), body.chat_template,
                                  plan.tools, body.template_kwargs())
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = max(state.engine.max_model_len - len(ids), 1)
    top_k = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling(state, body, max_tokens, top_k, structured,
                       skip_special_tokens=not plan.keeps_special_tokens)
    rid = state.engine.new_request_id("chatcmpl")
    session_id = body.session_id or body.user
    started = await start(request, state.engine, [(text, ids)], params, rid, body.cache_salt,
                          error_param="tools" if plan.schema() else
                          "structured_outputs" if body.structured_outputs else "response_format",
                          session_id=session_id)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model}
    thinking = (body.chat_template_kwargs or {}).get("enable_thinking") is not False
    parser = reasoning_parser(state.reasoning_parser if thinking else None, structured)

    if body.stream:
        return event_stream(
            _stream_chat(started, {**head, "object": "chat.completion.chunk"}, top_k,
                         params.max_stop_len(), _include_usage(body),
                         lambda: OutputEvents(plan, parser, text),
                         _session_hint(state, session_id)),
            request,
        )
    (final,) = await unless_disconnected(request, started.finals())
    choices = []
    for o in final.outputs:
        split = split_output(plan, parser, text, o.text)
        found = split.found
        message: dict[str, Any] = {"role": "assistant",
                                   "content": o.text if parser is None else found.content}
        if found.tools_called:
            if session_id:
                state.engine.hint_session(session_id)
            message = {"role": "assistant", "content": found.content,
                       "tool_calls": [_tool_call(c) for c in found.tool_calls]}
        if parser is not None:
            message["reasoning_content"] = split.reasoning
        choices.append({
            "index": o.index,
            "message": message,
            "logprobs": None if top_k is None else _chat_logprobs(o, 0, len(o.token_ids), top_k),
            "finish_reason": _finish_reason(o, found.tools_called),
            "stop_reason": o.stop_reason,
        })
    return JSONResponse({**head, "choices": choices, "usage": _usage([final])})


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _finish_reason(out: CompletionOutput, tools_called: bool) -> str | None:
    return "tool_calls" if tools_called and out.finish_reason == "stop" else out.finish_reason


def _delta(event: OutputEvent) -> dict[str, Any]:
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    call: dict[str, Any] = {"index": event.index}
    function: dict[str, Any] = {"arguments": event.arguments}
    if event.id is not None:
        call.update(id=event.id, type="function")
    if event.name is not None:
        function["name"] = event.name
    call["function"] = function
    return {"tool_calls": [call]}


def _session_hint(state, session_id: str | None) -> Callable[[], None] | None:
    """What to call when a turn ends in a tool call: the session will be back (KV offload
    prefetches its next turn)."""
    if session_id is None:
        return None
    return lambda: state.engine.hint_session(session_id)


async def _stream_chat(
    started: Started, head: dict, top_k: int | None, max_stop_len: int, include_usage: bool,
    new_events: Callable[[], OutputEvents], on_tool_call: Callable[[], None] | None = None,
) -> AsyncIterator[bytes]:
    streams = _streams(started, max_stop_len)
    tool_events: dict[int, OutputEvents] = {}
    extra = {"usage": None} if include_usage else {}
    for o in started.firsts[0].outputs:
        tool_events[o.index] = new_events()
        choice = {"index": o.index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        yield sse({**head, "choices": [choice], **extra})
    final = started.firsts[0]
    async for _, out in started.merged():
        final = out
        for o in out.outputs:
            s, events = streams[(0, o.index)], tool_events[o.index]
            step = s.advance(o)
            if step is None:
                continue
            text, lo, hi = step
            deltas = [_delta(e) for e in (events.feed(text) if text else [])]
            if s.done:
                deltas += [_delta(e) for e in events.finish()]
            deltas = deltas or [{}]
            for j, delta in enumerate(deltas):
                last = s.done and j == len(deltas) - 1
                choice = {
                    "index": o.index,
                    "delta": delta,
                    "logprobs": None if top_k is None or j else _chat_logprobs(o, lo, hi, top_k),
                    "finish_reason": _finish_reason(o, events.called) if last else None,
                }
                if last:
                    choice["stop_reason"] = o.stop_reason
                yield sse({**head, "choices": [choice], **extra})
    if on_tool_call is not None and any(e.called for e in tool_events.values()):
        on_tool_call()
    if include_usage:
        yield sse({**head, "choices": [], "usage": _usage([final])})
    yield sse("[DONE]")
