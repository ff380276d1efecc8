"""The FastAPI app: routes, error shapes, API-key check, body-size limit, health and metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.frontend.async_engine import AsyncLLM, EngineDeadError, EngineSleepingError
from tokenmill.server import anthropic_routes, openai_routes, pd, responses_routes, sleep_routes
from tokenmill.server.admission import DEFAULT_MAX_WAITING_REQUESTS, Admission
from tokenmill.server.chat import render_chat, served_template
from tokenmill.server.metrics import Metrics
from tokenmill.server.middleware import APIKeyMiddleware, LimitsMiddleware, RequestIdMiddleware
from tokenmill.server.pd import PDState
from tokenmill.server.protocol import DetokenizeRequest, TokenizeRequest
from tokenmill.server.reasoning import get_reasoning_parser
from tokenmill.server.render import RenderPool
from tokenmill.server.response_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES, ResponseStore
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
    error_response,
    internal_error,
    request_id,
    state_of,
)
from tokenmill.server.tool_parsers import get_tool_parser
from tokenmill.server.tool_parsers.detect import detect_tool_parser

logger = logging.getLogger("tokenmill.server")

def _version() -> str:
    try:
        return version("tokenmill")
    except PackageNotFoundError:
        return "unknown"


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
        response = error_response(request.url.path, exc.status, exc.message, exc.param, exc.code)
        response.headers.update(exc.headers)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        response = error_response(request.url.path, exc.status_code, str(exc.detail))
        for k, v in (exc.headers or {}).items():
            response.headers[k] = v
        return response

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> Response:
        return error_response(request.url.path, *internal_error(request_id(request.scope), exc))

    @app.exception_handler(EngineSleepingError)
    async def _asleep(request: Request, exc: EngineSleepingError) -> Response:
        return error_response(request.url.path, 503, str(exc))

    @app.exception_handler(RequestFailedError)
    async def _failed(request: Request, exc: RequestFailedError) -> Response:
        return error_response(request.url.path, *internal_error(request_id(request.scope), exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        # a bug: the client gets the request id, the log the traceback
        return error_response(request.url.path, *internal_error(request_id(request.scope), exc))

    @app.exception_handler(pd.Prefilled)
    async def _prefilled(request: Request, exc: pd.Prefilled) -> Response:
        return pd.prefilled_response(exc)

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
    enable_auto_tool_choice: bool = True,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    max_stored_responses: int = DEFAULT_MAX_RESPONSES,
    max_stored_response_bytes: int = DEFAULT_MAX_BYTES,
    compact_json: bool = False,
    enable_sleep_mode: bool = False,
    admin_api_key: str | None = None,
    trust_request_chat_template: bool = False,
    render_pool: RenderPool | None = None,
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    kv_role: str | None = None,
) -> FastAPI:
    """An app serving `engine`; the engine thread starts and stops with the app's lifespan.

    `tool_choice: auto` (what agents send with tools) is served unless
    `enable_auto_tool_choice` is False, reading the model's calls with `tool_call_parser`
    (a tool parser plugin's name); without one, the parser is chosen from the chat template (logged),
    the generic `json` parser when the template shows no one format.
    `reasoning_parser` (a reasoning parser plugin's name) splits reasoning from answers. The
    Responses API keeps at most `max_stored_responses`, of at most
    `max_stored_response_bytes`. `compact_json`: JSON that tools and output
    formats force has no optional whitespace (vLLM's `disable_any_whitespace`; small
    models otherwise may spend their max_tokens on whitespace). The routes that change the
    engine (sleep mode) exist only with `enable_sleep_mode`, and answer only
    `admin_api_key`. A request's own `chat_template` is refused unless
    `trust_request_chat_template`. Templates render, and prompts tokenize, on
    `render_pool` (a default `RenderPool` if None: bounded, time-limited). An unknown name,
    or sleep mode with no admin key, is a ValueError. A request that would leave more than
    `max_waiting_requests` sequences waiting for the engine is a 429 with Retry-After.
    """
    if enable_sleep_mode and not admin_api_key:
        raise ValueError("--enable-sleep-mode needs --admin-api-key (or TOKENMILL_ADMIN_API_KEY): "
                         "the sleep routes free the engine's memory and must not be open to "
                         "every client")
    if tool_call_parser is None and enable_auto_tool_choice:
        tool_call_parser = _choose_tool_parser(served_template(engine))
    # the plugin manager is asked once, here: requests get the classes
    tools = ToolConfig(enable_auto_tool_choice,
                       None if tool_call_parser is None else get_tool_parser(tool_call_parser))
    reasoning = None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)
    metrics = metrics or Metrics(served_model_names[0])
    metrics.bind_engine(lambda: engine.stats)
    if engine.observer is None:
        engine.observer = metrics

    render = render_pool or RenderPool()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            if pd_state is not None:
                await pd_state.close()
            render.shutdown()
            await asyncio.to_thread(engine.shutdown)

    # prefill/decode disaggregation (server/pd.py): with an engine that hands KV over
    pd_state = None if engine.kv_endpoint is None else PDState(
        kv_role or engine.args.kv_role, engine, engine.args.kv_lease_s, api_key)
    app = FastAPI(title="tokenmill", version=_version(), lifespan=lifespan)
    app.state.server = ServerState(
        engine, served_model_names, metrics, api_key, int(time.time()), tools, reasoning,
        compact_json, ResponseStore(max_stored_responses, max_stored_response_bytes), admin_api_key,
        trust_request_chat_template, render,
        Admission(max_waiting_requests, engine.args.max_num_seqs, lambda: engine.stats),
        pd_state,
    )
    _install_error_handlers(app)
    app.openapi = lambda: _openapi(app)
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    if enable_sleep_mode:
        app.include_router(sleep_routes.router)
    app.include_router(pd.router)
    _add_utility_routes(app)
    app.add_middleware(LimitsMiddleware)
    if api_key:
        admin = sleep_routes.ADMIN_PATHS if enable_sleep_mode else frozenset()
        app.add_middleware(APIKeyMiddleware, api_key=api_key, admin_paths=admin)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer carries the id
    return app


def _choose_tool_parser(template: str | None) -> str:
    name, why = detect_tool_parser(template)
    if name is None:
        logger.warning("tool-call parser: using json, the generic one, since %s; pass "
                       "--tool-call-parser to choose another", why)
        return "json"
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
            _, ids = await render_chat(state, msgs)
        else:
            encode = partial(state.engine.tokenizer.encode, body.prompt,
                             add_special_tokens=body.add_special_tokens)
            ids = await state.run_render(encode, "tokenizing the prompt", "prompt", timed=False)
        return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=OPENAI_ERRORS)
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
        state = state_of(request)
        state.check_model(body.model)
        size = len(state.engine.tokenizer)
        bad = [t for t in body.tokens if t >= size]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {size})", "tokens")
        decode = partial(state.engine.tokenizer.decode, list(body.tokens))
        return {"prompt": await state.run_render(decode, "detokenizing", "tokens", timed=False)}
