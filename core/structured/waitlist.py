"""Requests whose grammar is still compiling: held out of the scheduler, so that a new
constraint never stalls the step loop (and with it every running stream).

The API server compiles each constraint before it submits the request (a bad one is a 400
there), but the engine core, in a process of its own, needs its own compiled copy. When
its cache misses, the request waits here while a background thread compiles; each step
admits the ones whose grammar is ready and fails the ones whose compile failed.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any


class GrammarWaitlist:
    """Request id -> (the request, its compile). Used from the engine thread only."""

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[Any, Future]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def park(self, request_id: str, request: Any, compiling: Future) -> None:
        if request_id in self._waiting:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._waiting[request_id] = (request, compiling)

    def drop(self, request_ids: list[str]) -> list[str]:
        """Forget these requests (aborted); the ids that were waiting."""
        dropped = [rid for rid in request_ids if self._waiting.pop(rid, None) is not None]
        return dropped

    def ready(self) -> list[tuple[Any, Any, BaseException | None]]:
        """(request, compiled template or None, error or None) for every compile that has
        finished, in arrival order; those leave the list."""
        done = [(rid, req, f) for rid, (req, f) in self._waiting.items() if f.done()]
        for rid, _, _ in done:
            del self._waiting[rid]
        return [(req, None, f.exception()) if f.exception() is not None
                else (req, f.result(), None) for _, req, f in done]

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for any compile to finish (when nothing else can run)."""
        if self._waiting:
            wait([f for _, f in self._waiting.values()], timeout_s, FIRST_COMPLETED)
