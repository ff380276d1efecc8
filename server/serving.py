"""What the OpenAI and Anthropic routes share: server state, API errors, stream helpers."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from starlette.responses import Response, StreamingResponse

from tokenmill.frontend.async_engine import AsyncLLM, EngineDeadError
from tokenmill.frontend.outputs import RequestOutput
from tokenmill.platforms.reasoning import ReasoningParser
from tokenmill.platforms.tool_parsing import ToolParser
from tokenmill.server.admission import Admission, QueueFull
from tokenmill.server.metrics import Metrics
from tokenmill.server.render import RenderPool, RenderPoolFull
from tokenmill.server.response_store import ResponseStore

T = TypeVar("T")
logger = logging.getLogger("tokenmill.server")


@dataclass(frozen=True, slots=True)
class ToolConfig:
    """Whether `tool_choice: auto` is served, and which parser reads the model's calls."""

    enable_auto_tool_choice: bool = False  # build_app turns it on unless told not to
    tool_call_parser: type[ToolParser] | None = None  # resolved once, at start


@dataclass(slots=True)
class ServerState:
    """Everything a route needs, hung on `app.state.server`."""

    engine: AsyncLLM
    model_names: list[str]
    metrics: Metrics
    api_key: str | None = None
    created: int = 0
    tools: ToolConfig = field(default_factory=ToolConfig)
    reasoning_parser: type[ReasoningParser] | None = None  # --reasoning-parser, resolved
    compact_json: bool = False  # --structured-outputs-disable-any-whitespace
    responses: ResponseStore = field(default_factory=ResponseStore)
    admin_api_key: str | None = None  # --admin-api-key: the routes that change the engine
    trust_request_chat_template: bool = False  # --trust-request-chat-template
    render: RenderPool = field(default_factory=RenderPool)  # rendering and tokenizing
    admission: Admission | None = None  # the bound on waiting requests (build_app sets it)
    pd: Any = None  # prefill/decode disaggregation (server/pd.py's PDState); None: off

    async def run_render(self, fn: Callable[[], T], what: str = "rendering the prompt",
                         param: str | None = None, timed: bool = True) -> T:
        """`fn()` on the render pool: a 429 with Retry-After when the pool's queue is full,
        a 400 (naming `param`) when `fn` raises ValueError (a time or size limit included)."""
        try:
            return await self.render.run(fn, what, timed)
        except RenderPoolFull as e:
            raise APIError(429, str(e), code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from e
        except ValueError as e:
            raise APIError(400, str(e), param) from e

    def check_room(self) -> None:
        """A 429 with Retry-After, before any rendering, when even one more sequence would
        wait past --max-waiting-requests: a burst's refusals cost no render work and come
        at once. (`start` counts the request in later, with its true number of sequences.)"""
        if self.admission is None:
            return
        try:
            self.admission.check(1)
        except QueueFull as e:
            raise APIError(429, str(e), code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after_s)}) from e

    def check_model(self, name: str | None) -> str:
        """The served name to answer with; 404 for a model this server does not serve."""
        if name is None or name in self.model_names:
            return self.model_names[0] if name is None else name
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {self.model_names}",
            param="model",
            code="model_not_found",
        )


def request_id(scope) -> str:
    """The id RequestIdMiddleware gave this request ("-" outside it)."""
    return scope.get("state", {}).get("request_id", "-")


def state_of(request: Request) -> ServerState:
    return request.app.state.server


class APIError(Exception):
    """An error answered to the client; the route's family decides the body's shape."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}  # e.g. Retry-After on a 429


_OPENAI_TYPES = {
    401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
    429: "requests", 500: "server_error", 503: "server_error",
}
_ANTHROPIC_TYPES = {
    401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The error in the shape the route's SDK parses: OpenAI's, or Anthropic's on /v1/messages."""
    if is_anthropic_path(path):
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = _OPENAI_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def error_response(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None) -> Response:
    body = json.dumps(error_body(path, status, message, param, code))
    return Response(body, status_code=status, media_type="application/json")


_SSE_JSON = msgspec.json.Encoder()


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event, encoded; OpenAI streams have no `event:` line, Anthropic's do.

    msgspec writes the JSON (compact, keys in insertion order, non-ASCII as UTF-8) in a
    fraction of `json.dumps`'s time: one event per streamed token makes this a hot path.
    """
    payload = data.encode() if isinstance(data, str) else _SSE_JSON.encode(data)
    if event:
        return b"event: " + event.encode() + b"\ndata: " + payload + b"\n\n"
    return b"data: " + payload + b"\n\n"


class RequestFailedError(RuntimeError):
    """The engine ended this request with an error (finish_reason "error", the cause in its
    stop_reason); the engine and every other request go on. Answered as a 500."""


STRUCTURED_FAILURE = "structured output: "  # the core's stop_reason for a constraint that failed


def check_failed(out: RequestOutput) -> RequestOutput:
    """`out`, unless one of its sequences failed in the engine: then RequestFailedError, or
    a 400 when what failed is the request's own output constraint (a grammar past
    llguidance's limits at some step: the client's input, not the server)."""
    for seq in out.outputs:
        if seq.finish_reason != "error":
            continue
        reason = str(seq.stop_reason)
        if reason.startswith(STRUCTURED_FAILURE):
            raise APIError(400, "the output constraint failed while generating ("
                           f"{reason.removeprefix(STRUCTURED_FAILURE)}); simplify it")
        raise RequestFailedError(f"the engine could not finish this request: {reason}")
    return out


def internal_error(request_id: str, cause: BaseException) -> tuple[int, str]:
    """(status, message) for a failure whose text is the server's business: the cause is
    logged with the request id, and the client gets the id and no internal text."""
    if isinstance(cause, EngineDeadError):
        logger.error("request %s: the engine is dead: %s", request_id, cause)
        return 503, (f"the engine is not running (request id {request_id}; the server log has "
                     "the cause)")
    if isinstance(cause, RequestFailedError):
        logger.error("request %s: %s", request_id, cause)
        return 500, (f"the engine could not finish this request (request id {request_id}; the "
                     "server log has the cause); the server goes on")
    logger.error("request %s failed", request_id, exc_info=cause)
    return 500, f"internal server error (request id {request_id}; the server log has the details)"


def event_stream(events: AsyncIterator[bytes], request: Request) -> StreamingResponse:
    """An SSE response; if the engine dies or fails the request mid-stream (or anything
    else goes wrong), the stream ends with an error event in the route's shape, carrying
    the request id and no internal text, instead of a cut connection."""
    path, rid = request.url.path, request_id(request.scope)

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        except Exception as e:  # noqa: BLE001 - logged with the id; the client gets the id
            if isinstance(e, APIError):  # the request's own fault, found mid-stream
                body = error_body(path, e.status, e.message, e.param, e.code)
            else:
                body = error_body(path, *internal_error(rid, e))
            if is_anthropic_path(path):
                yield sse(body, "error")
            else:
                yield sse(body)
                yield sse("[DONE]")
        finally:
            await events.aclose()

    return StreamingResponse(guarded(), media_type="text/event-stream")


class DeltaText:
    """Per streamed sequence: how much of the cumulative text is safe to send.

    The engine cuts a stop string off the text when it finds it, and the stop may start up
    to `max_stop_len - 1` characters before the newest text. Those characters are held
    back until the sequence finishes, so nothing sent is ever cut later.
    """

    __slots__ = ("sent", "holdback")

    def __init__(self, max_stop_len: int) -> None:
        self.sent = 0
        self.holdback = max(max_stop_len - 1, 0)

    def next(self, text: str, finished: bool) -> str:
        end = len(text) if finished else max(self.sent, len(text) - self.holdback)
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine request) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    try:
        await task
    except asyncio.CancelledError:
        pass
    raise ClientDisconnected()


def usage_dict(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }
