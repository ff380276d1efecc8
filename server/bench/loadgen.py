"""An asyncio load generator for OpenAI-compatible servers, measuring at the client.

A workload is a list of `Session`s. Each session's turns run one after another (a turn
waits for the previous turn of its stream, then its pause); sessions run concurrently,
each starting at its `start_s`, under an optional cap on requests in flight. Independent
requests are sessions of one turn. Sessions that name a `slot` run back to back instead:
each starts when the one before it in its slot has finished, its times counted from
then (a fixed number of concurrent sessions over a window). Everything is bounded by
`time_limit_s`: turns that have not started by then are skipped and counted as not sent.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import httpx

from tokenmill.server.bench.stats import RequestResult

T = TypeVar("T")


@dataclass(slots=True)
class Turn:
    """One request. `prompt` goes to /v1/completions; `user` (chat sessions) is appended to
    the session's messages and sent to /v1/chat/completions with the history."""

    max_tokens: int
    prompt: str | None = None
    user: str | None = None
    pause_s: float = 0.0          # wait after the previous turn of the same stream ends
    at_s: float | None = None     # earliest send time relative to the run start (trace replay)
    stream: str = "main"          # turns of one stream are sequential (sub-agents run beside)
    expected_prompt_tokens: int = 0


@dataclass(slots=True)
class Session:
    name: str
    turns: list[Turn]
    start_s: float = 0.0
    chat: bool = False            # keep the conversation: append each reply to the history
    system: str | None = None
    slot: int | None = None       # sessions of one slot run one after another, in list order


@dataclass(slots=True)
class Target:
    base_url: str
    model: str
    extra_body: dict = field(default_factory=dict)  # engine-specific fields (ignore_eos, ...)


async def _send(client: httpx.AsyncClient, target: Target, turn: Turn, messages: list[dict] | None,
                res: RequestResult, t0: float) -> None:
    body = {"model": target.model, "max_tokens": turn.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **target.extra_body}
    if messages is not None:
        url, body["messages"] = "/v1/chat/completions", messages
    else:
        url, body["prompt"] = "/v1/completions", turn.prompt
    res.start = time.perf_counter() - t0
    sent = time.perf_counter()
    last = None
    chunks = 0
    parts: list[str] = []
    usage = None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content")
                if not piece:
                    continue
                now = time.perf_counter()
                res.output_tokens += 1  # chunks so far; usage replaces it at the end
                if last is None:
                    res.ttft = now - sent
                else:
                    res.itls.append(now - last)
                last = now
                chunks += 1
                parts.append(piece)
    res.e2e = time.perf_counter() - sent
    res.text = "".join(parts)
    if usage:
        res.output_tokens = usage.get("completion_tokens") or chunks
        res.prompt_tokens = usage.get("prompt_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            res.cached_tokens = details["cached_tokens"]
    res.ok = last is not None
    if not res.ok:
        res.error = "no content streamed"


async def _run_session(client, target, session: Session, sem: asyncio.Semaphore | None,
                       results: list[RequestResult], t0: float, deadline: float) -> None:
    if session.start_s > deadline:
        return
    await asyncio.sleep(max(0.0, session.start_s - (time.perf_counter() - t0)))
    messages: list[dict] = []
    if session.system:
        messages.append({"role": "system", "content": session.system})
    stream_done: dict[str, float] = {}
    streams: dict[str, asyncio.Lock] = {}

    async def one(i: int, turn: Turn) -> None:
        lock = streams.setdefault(turn.stream, asyncio.Lock())
        async with lock:
            # send after the stream's pause and not before at_s; a turn that would go after
            # the deadline is skipped now, not slept for (the run ends with its last response)
            now = time.perf_counter() - t0
            send_at = now + (turn.pause_s if turn.stream in stream_done else 0.0)
            if turn.at_s is not None:
                send_at = max(send_at, turn.at_s)
            if send_at > deadline:
                return
            await asyncio.sleep(send_at - now)
            res = RequestResult(session=session.name, turn=i, start=math.nan,
                                expected_prompt_tokens=turn.expected_prompt_tokens)
            msgs = None
            if session.chat:
                messages.append({"role": "user", "content": turn.user})
                msgs = list(messages)
            results.append(res)
            try:
                if sem is None:
                    await _send(client, target, turn, msgs, res, t0)
                else:
                    async with sem:
                        await _send(client, target, turn, msgs, res, t0)
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                res.error = f"{type(e).__name__}: {e}"
            if session.chat:
                messages.append({"role": "assistant", "content": res.text})
            stream_done[turn.stream] = time.perf_counter() - t0

    if session.chat:  # strictly sequential: each turn needs the previous reply
        for i, turn in enumerate(session.turns):
            await one(i, turn)
    else:
        await asyncio.gather(*(one(i, t) for i, t in enumerate(session.turns)))


def _shifted(session: Session, offset_s: float) -> Session:
    """The session with its start and every turn's earliest send time moved `offset_s` later."""
    turns = [t if t.at_s is None else replace(t, at_s=t.at_s + offset_s) for t in session.turns]
    return replace(session, start_s=session.start_s + offset_s, turns=turns)


async def _run_slot(client, target, sessions: list[Session], sem: asyncio.Semaphore | None,
                    results: list[RequestResult], t0: float, deadline: float) -> None:
    """Sessions back to back: each one's `start_s` and `at_s` count from the end of the one
    before (from the run start for the first). Stops at the deadline."""
    for session in sessions:
        now = time.perf_counter() - t0
        if now > deadline:
            return
        await _run_session(client, target, _shifted(session, now), sem, results, t0, deadline)


def run_client(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on uvloop when it is installed: a client on the server's own
    machine takes CPU from it, and uvloop's per-chunk cost is a fraction of asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def run_workload(target: Target, sessions: list[Session], max_concurrency: int | None,
                       time_limit_s: float, hard_limit_s: float | None = None,
                       timeout_s: float = 600.0) -> tuple[list[RequestResult], float]:
    """Run every session; returns the results and the wall time from start to last response.

    No turn starts after `time_limit_s`; at `hard_limit_s` requests still streaming are
    cancelled (their streamed tokens still count toward token throughput, they count as
    failed requests with error 'cancelled at the time limit')."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(base_url=target.base_url, timeout=timeout_s, limits=limits) as client:
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        results: list[RequestResult] = []
        t0 = time.perf_counter()
        slots: dict[int, list[Session]] = {}
        for s in sessions:
            if s.slot is not None:
                slots.setdefault(s.slot, []).append(s)
        work = asyncio.gather(
            *(_run_session(client, target, s, sem, results, t0, time_limit_s)
              for s in sessions if s.slot is None),
            *(_run_slot(client, target, group, sem, results, t0, time_limit_s)
              for group in slots.values()))
        try:
            await asyncio.wait_for(work, timeout=hard_limit_s)
        except TimeoutError:
            for r in results:
                if not r.ok and not r.error:
                    r.error = "cancelled at the time limit"
        return results, time.perf_counter() - t0
