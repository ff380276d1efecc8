"""The FastAPI app: routes, error shapes, API-key check, body-size limit, health and metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.async_engine import AsyncLLM, EngineDeadError, EngineSleepingError
from tokenmill.server import anthropic_routes, openai_routes, responses_routes, sleep_routes
from tokenmill.server.chat import served_template
from tokenmill.server.metrics import Metrics
from tokenmill.server.protocol import (
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.server.reasoning import get_reasoning_parser
from tokenmill.server.response_store import DEFAULT_MAX_RESPONSES, ResponseStore
from tokenmill.server.responses import (
    OPENAI_ERRORS,
    DetokenizeResponse,
    OpenAIError,
    TokenizeResponse,
    VersionResponse,
)
from tokenmill.server.serving import (
    APIError,
    ClientDisconnected,
    RequestFailedError,
    ServerState,
    ToolConfig,
    error_body,
    error_response,
    state_of,
)
from tokenmill.server.tool_parsers import get_tool_parser
from tokenmill.server.tool_parsers.detect import detect_tool_parser

logger = logging.getLogger("tokenmill.server")

# Paths answered without an API key, compared with the raw request path byte for byte, so
# no spelling of another path ("//v1/models", "/health/../v1/...", %-escapes) slips through.
PUBLIC_PATHS = frozenset({b"/health", b"/version", b"/metrics"})


def _version() -> str:
    try:
        return version("tokenmill")
    except PackageNotFoundError:
        return "unknown"


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer KEY` or `x-api-key: KEY` matches (constant time)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        message = "missing or invalid API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`"
        body = error_body(path, 401, message, code="invalid_api_key")
        await JSONResponse(body, status_code=401)(scope, receive, send)

    def _allowed(self, scope) -> bool:
        raw_path = scope.get("raw_path") or scope.get("path", "").encode()
        raw_path = raw_path.split(b"?", 1)[0]
        if raw_path in PUBLIC_PATHS:
            return True
        ok = False
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                ok |= hmac.compare_digest(value[7:].strip(), self.key)
            elif name == b"x-api-key":
                ok |= hmac.compare_digest(value.strip(), self.key)
        return ok


class LimitsMiddleware:
    """431 for headers over `max_header_bytes` in all; 413 for a body over `max_bytes`,
    declared or streamed.

    The body is read here in full (the routes would buffer it anyway) and replayed to the
    app, so an oversized chunked body is refused before any route sees it.
    """

    def __init__(
        self, app, max_bytes: int = MAX_BODY_BYTES, max_header_bytes: int = MAX_HEADER_BYTES
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header_bytes = sum(len(k) + len(v) for k, v in scope.get("headers", ()))
            if header_bytes > self.max_header_bytes:
                message = f"the request headers are over {self.max_header_bytes} bytes"
                await error_response(scope.get("path", ""), 431, message)(scope, receive, send)
                return
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        too_large = error_response(
            scope.get("path", ""), 413, f"the request body is over {self.max_bytes} bytes"
        )
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await too_large(scope, receive, send)
                return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return body
            return await receive()

        await self.app(scope, replay, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts), param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return error_response(request.url.path, 400, message, param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        response = error_response(request.url.path, exc.status_code, str(exc.detail))
        for k, v in (exc.headers or {}).items():
            response.headers[k] = v
        return response

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> Response:
        return error_response(request.url.path, 503, str(exc))

    @app.exception_handler(EngineSleepingError)
    async def _asleep(request: Request, exc: EngineSleepingError) -> Response:
        return error_response(request.url.path, 503, str(exc))

    @app.exception_handler(RequestFailedError)
    async def _failed(request: Request, exc: RequestFailedError) -> Response:
        return error_response(request.url.path, 500, str(exc))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)


# One server-sent event: OpenAI's carry JSON or "[DONE]" in `data`, Anthropic's name an `event`.
_SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without its 422 (we answer 400), and with the SSE alternative."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if op.get("operationId", "").startswith("create_"):  # stream=true answers SSE
                ok = responses.setdefault("200", {"description": "OK"}).setdefault("content", {})
                ok["text/event-stream"] = {"schema": _SSE_EVENT}
    app.openapi_schema = schema
    return schema


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    api_key: str | None = None,
    metrics: Metrics | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    max_stored_responses: int = DEFAULT_MAX_RESPONSES,
    compact_json: bool = False,
) -> FastAPI:
    """An app serving `engine`; the engine thread starts and stops with the app's lifespan.

    `tool_choice: auto` is served only with `enable_auto_tool_choice`, reading the model's
    calls with `tool_call_parser` (a registry name); without one, the parser is chosen
    from the chat template (logged), `hermes` when the template shows no one format.
    `reasoning_parser` (a registry name) splits reasoning from answers. The Responses
    API keeps at most `max_stored_responses`. `compact_json`: JSON that tools and output
    formats force has no optional whitespace (vLLM's `disable_any_whitespace`; small
    models otherwise may spend their max_tokens on whitespace). An unknown name is a
    ValueError.
    """
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)
    elif enable_auto_tool_choice:
        tool_call_parser = _choose_tool_parser(served_template(engine))
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)
    tools = ToolConfig(enable_auto_tool_choice, tool_call_parser)
    metrics = metrics or Metrics(served_model_names[0])
    metrics.bind_engine(lambda: engine.stats)
    if engine.observer is None:
        engine.observer = metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="tokenmill", version=_version(), lifespan=lifespan)
    app.state.server = ServerState(
        engine, served_model_names, metrics, api_key, int(time.time()), tools, reasoning_parser,
        compact_json, ResponseStore(max_stored_responses),
    )
    _install_error_handlers(app)
    app.openapi = lambda: _openapi(app)
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(sleep_routes.router)
    _add_utility_routes(app)
    app.add_middleware(LimitsMiddleware)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def _choose_tool_parser(template: str | None) -> str:
    name, why = detect_tool_parser(template)
    if name is None:
        logger.warning("tool-call parser: using hermes, the default, since %s; pass "
                       "--tool-call-parser to choose another", why)
        return "hermes"
    logger.info("tool-call parser: chose %s, since %s", name, why)
    return name


def _add_utility_routes(app: FastAPI) -> None:
    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "the engine is alive", "content": {}},
                   503: {"description": "the engine is dead", "model": OpenAIError}},
    )
    async def health(request: Request) -> Response:
        if state_of(request).engine.is_dead:
            return error_response(request.url.path, 503, "the engine is dead")
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def get_version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics(request: Request) -> Response:
        return PlainTextResponse(
            state_of(request).metrics.render(), media_type="text/plain; version=0.0.4"
        )

    @app.post("/tokenize", response_model=TokenizeResponse, responses=OPENAI_ERRORS)
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        state = state_of(request)
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of `prompt` and `messages`")
        if body.messages is not None:
            msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                _, ids = await state.engine.render_chat(msgs)
            except ValueError as e:
                raise APIError(400, str(e), "messages") from e
        else:
            ids = await state.engine.encode(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=OPENAI_ERRORS)
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
        state = state_of(request)
        state.check_model(body.model)
        size = len(state.engine.tokenizer)
        bad = [t for t in body.tokens if t >= size]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {size})", "tokens")
        return {"prompt": await state.engine.decode(body.tokens)}
