"""An instance's part in prefill/decode disaggregation (docs/disaggregation.md).

`tokenmill serve --kv-role prefill|decode` serves the usual routes; the router
(server/router.py) marks what it forwards with the `x-tokenmill-pd` header:

- `prefill`: the instance computes each prompt and samples its first token, holds the KV
  under a lease, and answers (whatever the route) with a msgpack `PrefillReply`: the
  lease ids, one per prompt.
- `prefill <decode URL>`: the same, for a conversation's next turn whose last turn that
  decode instance answered: first it asks it to lease the longest prefix of each prompt
  its prefix cache holds (`POST <decode URL>/v1/pd/prefix`: turn N's prompt and output),
  pulls what its own cache lacks, computes only the rest, and releases that lease. If
  the decode instance cannot be reached or holds nothing, the prompt is computed here.
- `decode <prefill URL> <lease id>,...`: the instance fetches the offers and the prefill
  engine's endpoint (`POST <prefill URL>/v1/pd/handover`), pulls what its own prefix
  cache lacks through the KV transport, and answers the route as usual (streaming too).
  When the pull ended it releases the lease (`POST <prefill URL>/v1/pd/release`). If the
  prefill instance cannot be reached, the prompt is computed here: one clean answer.

Offers and endpoints cross as msgpack (never pickle), over HTTP on the side channel the
instances already serve; the KV bytes move through the transport.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.frontend.outputs import RequestOutput
from tokenmill.kv_connector.handover.messages import HandoverIn, HandoverOffer
from tokenmill.platforms.kv_handover import EngineEndpoint
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.serving import APIError, check_failed, state_of, unless_disconnected

logger = logging.getLogger("tokenmill.server.pd")

PD_HEADER = "x-tokenmill-pd"
MSGPACK = "application/vnd.msgpack"


class PrefillReply(msgspec.Struct, frozen=True):
    """A prefill instance's answer: the lease of each prompt, in order."""

    engine_id: str
    lease_ids: list[str]


class HandoverFetch(msgspec.Struct, frozen=True):
    """What a decode instance fetches for its leases: the offers and how to reach the KV."""

    endpoint: EngineEndpoint
    offers: list[HandoverOffer]


class PrefixAsk(msgspec.Struct, frozen=True):
    """A prefill instance asks a decode instance to lease the longest cached prefix of
    `token_ids` (an agent's next turn pulling turn N's KV back)."""

    token_ids: list[int]
    cache_salt: str | None = None


class Prefilled(Exception):
    """Raised by a route on a prefill instance: answer with this msgpack reply."""

    def __init__(self, reply: PrefillReply) -> None:
        super().__init__(reply.lease_ids)
        self.reply = reply


@dataclass(slots=True)
class PDState:
    """A prefill or decode instance's handover bookkeeping (on `ServerState.pd`)."""

    role: str  # prefill, decode or both
    engine: AsyncLLM
    lease_s: float = 30.0
    api_key: str | None = None
    fetch_timeout_s: float = 10.0
    offers: dict[str, tuple[float, HandoverOffer]] = field(default_factory=dict)
    client: httpx.AsyncClient | None = None
    # decode side: handovers whose prefill instance could not be reached (computed here)
    fetch_failures: int = 0

    # ---- prefill side ------------------------------------------------------------------
    def keep(self, offer: HandoverOffer) -> None:
        now = time.monotonic()
        for lid in [lid for lid, (t, _) in self.offers.items() if t <= now]:
            del self.offers[lid]  # the engine freed their KV when the lease timed out
        self.offers[offer.lease_id] = (now + self.lease_s, offer)

    def fetch_local(self, lease_ids: list[str]) -> HandoverFetch:
        missing = [lid for lid in lease_ids if lid not in self.offers]
        if missing:
            raise APIError(404, f"no handover lease {missing} here: released, timed out or "
                           "never offered by this instance", code="lease_not_found")
        endpoint = self.engine.kv_endpoint
        return HandoverFetch(endpoint, [self.offers[lid][1] for lid in lease_ids])

    def release_local(self, lease_ids: list[str]) -> None:
        for lid in lease_ids:
            self.offers.pop(lid, None)
        self.engine.release(lease_ids)

    # ---- decode side -------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        if self.client is None:
            headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self.client = httpx.AsyncClient(timeout=self.fetch_timeout_s, headers=headers)
        return self.client

    async def fetch(self, url: str, lease_ids: list[str]) -> HandoverFetch:
        reply = await self._http().post(f"{url}/v1/pd/handover",
                                        content=msgspec.msgpack.encode(lease_ids),
                                        headers={"content-type": MSGPACK})
        if reply.status_code != 200:
            raise httpx.HTTPStatusError(f"{url} answered {reply.status_code}: {reply.text}",
                                        request=reply.request, response=reply)
        return msgspec.msgpack.decode(reply.content, type=HandoverFetch)

    async def fetch_prefix(self, url: str, token_ids: list[int],
                           cache_salt: str | None) -> HandoverFetch:
        """Ask the decode instance at `url` to lease its cached prefix of `token_ids`
        (no offer: it holds none)."""
        reply = await self._http().post(f"{url}/v1/pd/prefix",
                                        content=msgspec.msgpack.encode(
                                            PrefixAsk(token_ids, cache_salt)),
                                        headers={"content-type": MSGPACK})
        if reply.status_code != 200:
            raise httpx.HTTPStatusError(f"{url} answered {reply.status_code}: {reply.text}",
                                        request=reply.request, response=reply)
        return msgspec.msgpack.decode(reply.content, type=HandoverFetch)

    async def lease_local_prefix(self, ask: PrefixAsk) -> HandoverFetch:
        """Decode side: lease the longest cached prefix of `ask.token_ids` (kept until the
        asking instance releases it, or the lease times out)."""
        last = None
        async for out in self.engine.generate(ask.token_ids, SamplingParams(max_tokens=1),
                                              f"prefix-{uuid.uuid4().hex}",
                                              cache_salt=ask.cache_salt, lease_prefix=True):
            last = out
        offer = check_failed(last).kv_offer
        if offer is not None:
            self.keep(offer)
        return HandoverFetch(self.engine.kv_endpoint, [] if offer is None else [offer])

    def release_remote(self, url: str, lease_ids: list[str]) -> None:
        """Tell the prefill instance its leases can go (in the background, best effort:
        a lease nobody releases times out there)."""
        async def send() -> None:
            try:
                await self._http().post(f"{url}/v1/pd/release",
                                        content=msgspec.msgpack.encode(lease_ids),
                                        headers={"content-type": MSGPACK})
            except httpx.HTTPError as e:
                logger.warning("releasing leases %s at %s failed (they time out there): %s",
                               lease_ids, url, e)

        asyncio.ensure_future(send())

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None


def _pd(request: Request) -> PDState:
    pd = state_of(request).pd
    if pd is None:
        raise APIError(400, f"this instance hands no KV over ({PD_HEADER} or /v1/pd/): start "
                       "it with --kv-role prefill|decode", code="not_disaggregated")
    return pd


async def handover_generators(
    request: Request,
    engine: AsyncLLM,
    prompts: list[tuple[str | None, list[int]]],
    params: SamplingParams,
    request_id: str,
    cache_salt: str | None,
    session_id: str | None,
) -> list[AsyncIterator[RequestOutput]] | None:
    """The engine requests for a route's prompts when the router marked it (None: not
    marked, the route runs as usual). A prefill instance runs them here and raises
    `Prefilled`; a decode instance gets generators that continue from the pulled KV."""
    header = request.headers.get(PD_HEADER)
    if header is None:
        return None
    pd = _pd(request)

    def rid(i: int) -> str:
        return request_id if len(prompts) == 1 else f"{request_id}-{i}"

    if header == "prefill" or header.startswith("prefill "):
        if pd.role == "decode":
            raise APIError(400, "this is a decode instance; send prefills to a prefill one")
        back = header.removeprefix("prefill").strip() or None
        await _prefill(request, pd, engine, prompts, params, [rid(i) for i in range(len(prompts))],
                       cache_salt, session_id, back)
    parts = header.split(" ")
    if len(parts) != 3 or parts[0] != "decode":
        raise APIError(400, f"bad {PD_HEADER} header {header!r}: expected 'prefill' or "
                       "'decode <prefill URL> <lease id>,...'")
    _, url, leases = parts
    lease_ids = leases.split(",")
    if len(lease_ids) != len(prompts):
        raise APIError(400, f"{len(lease_ids)} leases for {len(prompts)} prompts")
    try:
        fetched = await pd.fetch(url, lease_ids)
    except (httpx.HTTPError, msgspec.DecodeError) as e:
        # the prefill instance is gone (or forgot the leases): compute the prompts here
        pd.fetch_failures += 1
        logger.warning("handover from %s failed (%s): computing the prompts here", url, e)
        return [engine.generate(ids, params, rid(i), text, cache_salt, session_id)
                for i, (text, ids) in enumerate(prompts)]
    return [
        _released(engine.generate(ids, params, rid(i), text, cache_salt, session_id,
                                  handover_in=HandoverIn(offer, fetched.endpoint)),
                  pd, url, offer.lease_id)
        for i, ((text, ids), offer) in enumerate(zip(prompts, fetched.offers, strict=True))
    ]


async def _pulled_back(pd: PDState, url: str | None, prompt_ids: list[int],
                       cache_salt: str | None) -> HandoverIn | None:
    """The decode instance at `url`'s lease of its cached prefix of `prompt_ids` (turn N's
    KV for turn N + 1), or None (no URL, nothing cached, unreachable: computed here)."""
    if url is None:
        return None
    try:
        fetched = await pd.fetch_prefix(url, prompt_ids, cache_salt)
    except (httpx.HTTPError, msgspec.DecodeError) as e:
        logger.warning("asking %s for the conversation's KV failed (%s): computing it here",
                       url, e)
        return None
    return HandoverIn(fetched.offers[0], fetched.endpoint) if fetched.offers else None


async def _prefill(request, pd: PDState, engine: AsyncLLM, prompts, params, ids: list[str],
                   cache_salt, session_id, back: str | None = None) -> None:
    if params.n != 1:
        raise APIError(400, f"a disaggregated request has one sequence per prompt; n={params.n}",
                       param="n")

    async def one(i: int, prompt_ids: list[int], text: str | None) -> RequestOutput:
        last = None
        pulled = await _pulled_back(pd, back, prompt_ids, cache_salt)
        gen = engine.generate(prompt_ids, params, ids[i], text, cache_salt, session_id,
                              handover_out=True, handover_in=pulled)
        if pulled is not None:
            gen = _released(gen, pd, back, pulled.offer.lease_id)
        async for out in gen:
            last = out
        return check_failed(last)

    try:
        finals = await unless_disconnected(request, asyncio.gather(
            *(one(i, p, t) for i, (t, p) in enumerate(prompts))))
    except ValueError as e:
        raise APIError(400, str(e)) from e
    offers = [f.kv_offer for f in finals]
    if any(o is None for o in offers):
        raise APIError(500, "the prefill engine finished a request without a handover offer")
    for offer in offers:
        pd.keep(offer)
    raise Prefilled(PrefillReply(offers[0].engine_id, [o.lease_id for o in offers]))


async def _released(gen: AsyncIterator[RequestOutput], pd: PDState, url: str,
                    lease_id: str) -> AsyncIterator[RequestOutput]:
    """`gen`, releasing the prefill instance's lease once the pull ended (or the request
    did)."""
    released = False
    try:
        async for out in gen:
            if out.kv_pulled and not released:
                released = True
                pd.release_remote(url, [lease_id])
            yield out
    finally:
        if not released:
            pd.release_remote(url, [lease_id])
        await gen.aclose()


router = APIRouter()


def _lease_ids(body: bytes) -> list[str]:
    try:
        return msgspec.msgpack.decode(body, type=list[str])
    except msgspec.DecodeError as e:
        raise APIError(400, f"expected a msgpack list of lease ids: {e}") from e


@router.post("/v1/pd/handover", include_in_schema=False)
async def handover(request: Request) -> Response:
    """The offers of these leases and this engine's endpoint (msgpack HandoverFetch)."""
    lease_ids = _lease_ids(await request.body())
    fetched = _pd(request).fetch_local(lease_ids)
    return Response(msgspec.msgpack.encode(fetched), media_type=MSGPACK)


@router.post("/v1/pd/prefix", include_in_schema=False)
async def prefix(request: Request) -> Response:
    """Lease the longest cached prefix of a prompt (msgpack PrefixAsk) for a prefill
    instance to pull: msgpack HandoverFetch, with no offer when nothing is cached."""
    try:
        ask = msgspec.msgpack.decode(await request.body(), type=PrefixAsk)
    except msgspec.DecodeError as e:
        raise APIError(400, f"expected a msgpack PrefixAsk: {e}") from e
    fetched = await _pd(request).lease_local_prefix(ask)
    return Response(msgspec.msgpack.encode(fetched), media_type=MSGPACK)


@router.post("/v1/pd/release", include_in_schema=False)
async def release(request: Request) -> Response:
    lease_ids = _lease_ids(await request.body())
    _pd(request).release_local(lease_ids)
    return Response(status_code=204)


def prefilled_response(exc: Prefilled) -> Response:
    return Response(msgspec.msgpack.encode(exc.reply), media_type=MSGPACK,
                    headers={PD_HEADER: "prefilled"})
