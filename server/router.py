"""`tokenmill router`: one OpenAI- and Anthropic-compatible endpoint in front of prefill and
decode instances (`tokenmill serve --kv-role prefill|decode`; docs/disaggregation.md).

For each generation request (chat, completions, Responses, messages) the router picks a
prefill instance and forwards the body marked `x-tokenmill-pd: prefill`: it computes the
prompt and holds its KV under a lease, answering with the leases (server/pd.py). Then it
forwards the same body to a decode instance marked with the prefill instance's URL and
the leases: the decode instance pulls the KV and answers the client's route, streaming
included; the router relays the bytes as they come.

Choice: a conversation's next turn goes where its KV is (prefix affinity, keyed by the
start of its prompt), else the instance with the fewest requests in flight. Faults: a
prefill instance that fails (connection refused, reset, 5xx) is skipped for the next one,
and without one the decode instance computes the prompt itself; a decode instance that
cannot be reached is skipped for the next; one that dies mid-answer ends the client's
stream with a 503 error in the route's shape, and the prefill leases are released.
Requests a handover does not cover (n > 1, a Responses `previous_response_id`, whose
history only the decode instance that answered it holds) go to a decode instance whole.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import msgspec
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.responses import JSONResponse, Response, StreamingResponse

from tokenmill.server.pd import MSGPACK, PD_HEADER, PrefillReply
from tokenmill.server.serving import error_body, error_response, sse

logger = logging.getLogger("tokenmill.router")

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
_FORWARDED = ("authorization", "x-api-key", "anthropic-version", "anthropic-beta",
              "content-type", "openai-organization")
_AFFINITY_ENTRIES = 65536


@dataclass(slots=True)
class Instance:
    url: str
    in_flight: int = 0
    failures: int = 0  # consecutive; an instance that failed sorts after the others


@dataclass(slots=True)
class Pool:
    """Instances of one role, chosen by affinity then load."""

    instances: list[Instance]
    affinity: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def order(self, key: str | None) -> list[Instance]:
        """Every instance, best first: the key's last one (if it has not failed), then
        the fewest failures and requests in flight."""
        ranked = sorted(self.instances, key=lambda i: (i.failures > 0, i.in_flight))
        url = self.affinity.get(key) if key is not None else None
        for inst in ranked:
            if inst.url == url and inst.failures == 0:
                ranked.remove(inst)
                ranked.insert(0, inst)
                break
        return ranked

    def served(self, key: str | None, inst: Instance) -> None:
        inst.failures = 0
        if key is not None:
            self.affinity[key] = inst.url
            self.affinity.move_to_end(key)
            while len(self.affinity) > _AFFINITY_ENTRIES:
                self.affinity.popitem(last=False)


def affinity_key(path: str, body: dict) -> str | None:
    """What a conversation's turns share: the system prompt and first message (chat,
    messages, Responses input), or the prompt's first 512 characters or tokens
    (completions)."""
    if path == "/v1/completions":
        head = body.get("prompt")  # text: its first 512 characters; ids: 512 tokens
        head = head[:512] if isinstance(head, (str, list)) else None
    elif path == "/v1/responses":
        items = body.get("input")
        head = [body.get("instructions"), items if isinstance(items, str) else
                (items[:1] if isinstance(items, list) else None)]
    else:
        head = [body.get("system"), (body.get("messages") or [])[:2]]
    if head is None:
        return None
    return hashlib.sha256(json.dumps(head, sort_keys=True, default=str).encode()).hexdigest()


def handover_applies(path: str, body: dict) -> bool:
    """Whether a prefill instance can compute this request for a decode instance."""
    if (body.get("n") or 1) != 1 or body.get("best_of") not in (None, 1):
        return False
    return not (path == "/v1/responses" and body.get("previous_response_id"))


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tokenmill_router_requests", "requests routed, by how",
                                ["route"], registry=self.registry)
        self.failures = Counter("tokenmill_router_instance_failures",
                                "instances that failed a request, by role", ["role"],
                                registry=self.registry)


class Router:
    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float = 600.0) -> None:
        if not decode:
            raise ValueError("the router needs at least one --decode instance URL")
        self.prefill = Pool([Instance(u.rstrip("/")) for u in prefill])
        self.decode = Pool([Instance(u.rstrip("/")) for u in decode])
        self.metrics = RouterMetrics()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def close(self) -> None:
        await self.client.aclose()

    # ---- the two legs ------------------------------------------------------------------
    async def _prefill(self, path: str, raw: bytes, headers: dict, key: str | None,
                       ) -> tuple[Instance, PrefillReply] | Response | None:
        """The leases of a prefill instance that computed the prompt; a Response to give
        the client as is (it refused the request: 4xx); None: no prefill instance could.
        A conversation's next turn names the decode instance that answered its last one:
        the prefill instance pulls that turn's KV back from it (server/pd.py)."""
        back = self.decode.affinity.get(key) if key is not None else None
        mark = f"prefill {back}" if back else "prefill"
        for inst in self.prefill.order(key):
            inst.in_flight += 1
            try:
                reply = await self.client.post(inst.url + path, content=raw,
                                               headers={**headers, PD_HEADER: mark})
            except httpx.HTTPError as e:
                logger.warning("prefill instance %s failed: %s; trying the next", inst.url, e)
                reply = None
            finally:
                inst.in_flight -= 1
            if reply is not None and reply.headers.get("content-type") == MSGPACK:
                self.prefill.served(key, inst)
                return inst, msgspec.msgpack.decode(reply.content, type=PrefillReply)
            if reply is not None and 400 <= reply.status_code < 500:
                return Response(reply.content, reply.status_code,
                                media_type=reply.headers.get("content-type"))
            inst.failures += 1
            self.metrics.failures.labels("prefill").inc()
        return None

    async def _release(self, prefilled: tuple[Instance, PrefillReply] | None) -> None:
        if prefilled is None:
            return
        inst, reply = prefilled
        try:
            await self.client.post(inst.url + "/v1/pd/release",
                                   content=msgspec.msgpack.encode(reply.lease_ids),
                                   headers={"content-type": MSGPACK})
        except httpx.HTTPError as e:
            logger.warning("releasing %s at %s failed (they time out): %s",
                           reply.lease_ids, inst.url, e)

    async def route(self, request: Request) -> Response:
        path = request.url.path
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return error_response(path, 400, "the request body is not JSON")
        if not isinstance(body, dict):
            return error_response(path, 400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED}
        key = affinity_key(path, body)
        prefilled = None
        if handover_applies(path, body) and self.prefill.instances:
            prefilled = await self._prefill(path, raw, headers, key)
            if isinstance(prefilled, Response):
                self.metrics.requests.labels("refused").inc()
                return prefilled
        self.metrics.requests.labels("handover" if prefilled else "decode_only").inc()
        if prefilled is not None:
            inst, reply = prefilled
            headers[PD_HEADER] = f"decode {inst.url} {','.join(reply.lease_ids)}"
        for inst in self.decode.order(key):
            inst.in_flight += 1
            try:
                upstream = await self.client.send(
                    self.client.build_request("POST", inst.url + path, content=raw,
                                              headers=headers), stream=True)
            except httpx.HTTPError as e:
                inst.in_flight -= 1
                inst.failures += 1
                self.metrics.failures.labels("decode").inc()
                logger.warning("decode instance %s failed: %s; trying the next", inst.url, e)
                continue
            self.decode.served(key, inst)
            if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                return await self._whole(upstream, inst, path, prefilled)
            return StreamingResponse(
                self._relay(upstream, inst, path, prefilled), upstream.status_code,
                media_type=upstream.headers.get("content-type"))
        await self._release(prefilled)
        return error_response(path, 503, "no decode instance could take the request: "
                              f"{[i.url for i in self.decode.instances]} all failed")

    async def _whole(self, upstream: httpx.Response, inst: Instance, path: str,
                     prefilled) -> Response:
        """A JSON answer, read whole: a decode instance that dies meanwhile is a 503."""
        try:
            content = await upstream.aread()
        except httpx.HTTPError as e:
            inst.failures += 1
            self.metrics.failures.labels("decode").inc()
            await self._release(prefilled)
            return error_response(path, 503, f"the decode instance failed mid-answer: {e}")
        finally:
            inst.in_flight -= 1
            await upstream.aclose()
        return Response(content, upstream.status_code,
                        media_type=upstream.headers.get("content-type"))

    async def _relay(self, upstream: httpx.Response, inst: Instance, path: str,
                     prefilled) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            inst.failures += 1
            self.metrics.failures.labels("decode").inc()
            logger.warning("decode instance %s died mid-answer: %s", inst.url, e)
            await self._release(prefilled)
            message = f"the decode instance failed mid-answer: {e}"
            body = error_body(path, 503, message)
            yield sse(body, "error" if path.startswith("/v1/messages") else None)
        finally:
            inst.in_flight -= 1
            await upstream.aclose()


def build_router_app(prefill: list[str], decode: list[str]) -> FastAPI:
    router = Router(prefill, decode)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="tokenmill router", lifespan=lifespan)
    app.state.router = router
    for path in GENERATION_PATHS:
        app.add_api_route(path, router.route, methods=["POST"], include_in_schema=False)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for inst in router.decode.order(None):
            try:
                reply = await router.client.get(inst.url + "/v1/models", headers={
                    k: v for k, v in request.headers.items() if k in _FORWARDED})
            except httpx.HTTPError:
                continue
            return Response(reply.content, reply.status_code,
                            media_type=reply.headers.get("content-type"))
        return error_response("/v1/models", 503, "no decode instance answers")

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"prefill": [i.url for i in router.prefill.instances],
                             "decode": [i.url for i in router.decode.instances]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry),
                        media_type="text/plain; version=0.0.4")

    return app


def add_parser(sub) -> None:
    p = sub.add_parser("router", allow_abbrev=False,
                       help="one endpoint in front of prefill and decode instances "
                            "(docs/disaggregation.md)")
    p.add_argument("--prefill", nargs="*", default=[], metavar="URL",
                   help="prefill instances (tokenmill serve --kv-role prefill)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances (tokenmill serve --kv-role decode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.server.http_server import uvicorn_options

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(levelname)s %(name)s: %(message)s")
    app = build_router_app(args.prefill, args.decode)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level, **uvicorn_options()))
    server.run()
    return 0 if server.started else 1
