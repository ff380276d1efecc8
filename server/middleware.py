"""ASGI middleware in front of every route: request ids, the API keys and the size limits."""

from __future__ import annotations

import hmac
import re
import secrets

from fastapi.responses import JSONResponse

from tokenmill.server.protocol import MAX_BODY_BYTES, MAX_HEADER_BYTES
from tokenmill.server.serving import error_body, error_response

# Paths answered without an API key, compared with the raw request path byte for byte, so
# no spelling of another path ("//v1/models", "/health/../v1/...", %-escapes) slips through.
PUBLIC_PATHS = frozenset({b"/health", b"/version", b"/metrics"})


def presented_keys(headers) -> list[bytes]:
    """The keys a request carries: `Authorization: Bearer KEY` and `x-api-key: KEY`."""
    keys = []
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            keys.append(value[7:].strip())
        elif name == b"x-api-key":
            keys.append(value.strip())
    return keys


def key_matches(keys: list[bytes], key: str | None) -> bool:
    """Whether one of `keys` is `key`, compared in constant time (never with no key)."""
    if not key:
        return False
    expected, ok = key.encode(), False
    for k in keys:
        ok |= hmac.compare_digest(k, expected)
    return ok


class APIKeyMiddleware:
    """401 unless the client key (`Authorization: Bearer KEY` or `x-api-key: KEY`) matches.

    Routes that change the engine (`admin_paths`, decoded paths) are let through to their
    own check of the admin key (`sleep_routes.require_admin`, which runs on whatever
    spelling of the path reached the route), so a request there needs no client key.
    """

    def __init__(self, app, api_key: str, admin_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.key = api_key
        self.admin_paths = admin_paths

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
        if raw_path in PUBLIC_PATHS or scope.get("path") in self.admin_paths:
            return True
        return key_matches(presented_keys(scope.get("headers", ())), self.key)


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


_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


class RequestIdMiddleware:
    """Gives every HTTP request an id: the client's `x-request-id` when it sends a plain one,
    else `req_<hex>`. Routes read it with `serving.request_id(scope)`; every response carries it as
    `x-request-id` and `request-id` (the header Anthropic's SDK reads), and the server logs
    every error with it, so a client can quote it without ever seeing internal text."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", ())).get(b"x-request-id", b"")
        rid = given.decode() if _CLIENT_ID.fullmatch(given) else f"req_{secrets.token_hex(12)}"
        scope.setdefault("state", {})["request_id"] = rid
        raw = rid.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                headers += [(b"x-request-id", raw), (b"request-id", raw)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
