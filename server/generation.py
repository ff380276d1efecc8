"""Running engine requests for a route: priming (so bad prompts fail before any byte of a
stream is sent), merging several prompts' streams, and per-sequence stream bookkeeping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from tokenmill.frontend.async_engine import AsyncLLM, EngineDeadError
from tokenmill.frontend.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.admission import QueueFull, Ticket
from tokenmill.server.pd import handover_generators
from tokenmill.server.serving import (
    APIError,
    DeltaText,
    check_failed,
    internal_error,
    state_of,
    unless_disconnected,
)
from tokenmill.server.serving import request_id as http_request_id
from tokenmill.structured import StructuredOutputError

_DONE = object()


@dataclass(slots=True)
class Started:
    """Requests accepted by the engine, each with its first output."""

    gens: list[AsyncIterator[RequestOutput]]
    firsts: list[RequestOutput]

    async def close(self) -> None:
        for g in self.gens:
            await g.aclose()

    async def finals(self) -> list[RequestOutput]:
        """Consume every request to its last output (closing them if cancelled)."""
        async def last(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
            out = first
            async for newer in gen:
                out = newer
            return check_failed(out)

        try:
            return list(await asyncio.gather(*(last(f, g) for f, g in zip(self.firsts, self.gens))))
        finally:
            await self.close()

    async def merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all requests as they come, first outputs first."""
        try:
            for i, first in enumerate(self.firsts):
                yield i, check_failed(first)
            running = [(i, g) for i, (g, f) in enumerate(zip(self.gens, self.firsts)) if not f.finished]
            if len(running) == 1:
                i, gen = running[0]
                async for out in gen:
                    yield i, check_failed(out)
            elif running:
                interleaved = _interleave(running)
                try:
                    async for i, out in interleaved:
                        yield i, check_failed(out)
                finally:
                    await interleaved.aclose()
        finally:
            await self.close()


async def _interleave(
    gens: list[tuple[int, AsyncIterator[RequestOutput]]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    items: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await items.put((i, out))
        except Exception as e:  # handed to the consumer, which re-raises it
            await items.put((i, e))
        finally:
            await items.put((i, _DONE))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in gens]
    try:
        remaining = len(tasks)
        while remaining:
            i, out = await items.get()
            if out is _DONE:
                remaining -= 1
            elif isinstance(out, Exception):
                raise out
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def start(
    request: Request,
    engine: AsyncLLM,
    prompts: list[tuple[str | None, list[int]]],
    params: SamplingParams,
    request_id: str,
    cache_salt: str | None = None,
    error_param: str | None = None,
    session_id: str | None = None,
) -> Started:
    """Submit one engine request per prompt and wait for each one's first output.

    A request that would wait past the server's bound is a 429 with Retry-After (nothing
    is submitted); a prompt the engine refuses becomes a 400 (naming `error_param` if the
    refusal is a bad structured-output schema), a dead engine a 503; a client that leaves
    meanwhile aborts them all.
    """
    admission = state_of(request).admission
    try:
        admission.admit(len(prompts) * params.n)
    except QueueFull as e:
        raise APIError(429, str(e), code="rate_limit_exceeded",
                       headers={"Retry-After": str(e.retry_after_s)}) from e
    except ValueError as e:
        raise APIError(400, str(e), "n") from e
    ticket = Ticket(admission, len(prompts) * params.n)
    try:  # a disaggregated request (server/pd.py): prefilled here, or continued
        handed = await handover_generators(request, engine, prompts, params, request_id,
                                           cache_salt, session_id)
    except BaseException:
        ticket.release()
        raise
    gens = [
        _released(handed[i] if handed is not None else engine.generate(
            ids, params, request_id if len(prompts) == 1 else f"{request_id}-{i}", text,
            cache_salt, session_id,
        ), ticket, params.n)
        for i, (text, ids) in enumerate(prompts)
    ]
    tasks = [asyncio.ensure_future(anext(g)) for g in gens]
    try:
        firsts = await unless_disconnected(request, asyncio.gather(*tasks))
    except BaseException as e:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
        ticket.release()  # also the share of a generator that never started
        if isinstance(e, EngineDeadError):
            raise APIError(*internal_error(http_request_id(request.scope), e)) from e
        if isinstance(e, ValueError):
            param = error_param if isinstance(e, StructuredOutputError) else None
            raise APIError(400, str(e), param) from e
        raise
    return Started(gens, list(firsts))


async def _released(gen: AsyncIterator[RequestOutput], ticket: Ticket, num_seqs: int
                    ) -> AsyncIterator[RequestOutput]:
    """`gen`'s outputs; its sequences leave the admission count when it ends, however."""
    try:
        async for out in gen:
            yield out
    finally:
        await gen.aclose()
        ticket.release(num_seqs)


@dataclass(slots=True)
class SeqStream:
    """One streamed sequence: what was sent of its text and tokens, and whether it ended."""

    text: DeltaText
    num_tokens: int = 0
    done: bool = False
    started: bool = field(default=False)

    def advance(self, out: CompletionOutput) -> tuple[str, int, int] | None:
        """(new text, first new token index, end token index), or None if nothing new."""
        if self.done:
            return None
        finished = out.finish_reason is not None
        delta = self.text.next(out.text, finished)
        lo, hi = self.num_tokens, len(out.token_ids)
        self.num_tokens = hi
        self.done = finished
        if not delta and lo == hi and not finished:
            return None
        return delta, lo, hi


def params_or_400(**kw) -> SamplingParams:
    try:
        return SamplingParams(**{k: v for k, v in kw.items() if v is not None})
    except ValueError as e:
        raise APIError(400, str(e)) from e
