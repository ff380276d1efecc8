"""What the OpenAI and Anthropic routes share: server state, API errors, stream helpers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from starlette.responses import Response, StreamingResponse

from tokenmill.async_engine import AsyncLLM, EngineDeadError
from tokenmill.outputs import RequestOutput
from tokenmill.server.metrics import Metrics
from tokenmill.server.response_store import ResponseStore

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ToolConfig:
    """Whether `tool_choice: auto` is served, and which parser reads the model's calls."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass(slots=True)
class ServerState:
    """Everything a route needs, hung on `app.state.server`."""

    engine: AsyncLLM
    model_names: list[str]
    metrics: Metrics
    api_key: str | None = None
    created: int = 0
    tools: ToolConfig = field(default_factory=ToolConfig)
    reasoning_parser: str | None = None  # --reasoning-parser
    compact_json: bool = False  # --structured-outputs-disable-any-whitespace
    responses: ResponseStore = field(default_factory=ResponseStore)

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


def state_of(request: Request) -> ServerState:
    return request.app.state.server


class APIError(Exception):
    """An error answered to the client; the route's family decides the body's shape."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


_OPENAI_TYPES = {
    401: "authentication_error", 404: "invalid_request_error", 500: "server_error", 503: "server_error",
}
_ANTHROPIC_TYPES = {
    401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 500: "api_error", 503: "overloaded_error",
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


def check_failed(out: RequestOutput) -> RequestOutput:
    """`out`, unless one of its sequences failed in the engine: then RequestFailedError."""
    for seq in out.outputs:
        if seq.finish_reason == "error":
            raise RequestFailedError(f"the engine could not finish this request: {seq.stop_reason}")
    return out


def event_stream(events: AsyncIterator[bytes], path: str) -> StreamingResponse:
    """An SSE response; if the engine dies or fails the request mid-stream, the stream ends
    with an error event in the route's shape instead of a cut connection."""

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        except (EngineDeadError, RequestFailedError) as e:
            body = error_body(path, 503 if isinstance(e, EngineDeadError) else 500, str(e))
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
