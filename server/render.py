"""Rendering chat templates and tokenizing, for the routes: on a bounded pool of threads of
their own, each job under a time limit, each rendered prompt under a size limit.

Why a pool of its own: rendering and tokenizing are CPU work on the request path; on
asyncio's default executor they would queue behind (and ahead of) everything else, and an
unbounded number of them would take the interpreter from the event loop that answers
`/health`. Here at most `workers` run at once, at most `max_pending` wait (more is a 429
with Retry-After), and the health route never waits for either.

Why a time limit: a chat template is a program. The server's own is trusted, but it runs
over client data (a quadratic template over 4 MiB of messages never ends), and a
request-supplied one (`--trust-request-chat-template`) is client code. A thread cannot be
killed, so a watchdog raises `_Interrupted` in the job's thread when its time is up
(CPython's `PyThreadState_SetAsyncExc`, which takes effect between two bytecodes: jinja's
compiled templates are Python bytecode, so every loop of a template is interruptible;
one long C call, such as tokenizing a huge text, finishes first and is bounded by the body
size limit). The job then fails with `RenderLimitError` (a 400) and its thread goes back to
the pool.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

DEFAULT_WORKERS = 2
DEFAULT_MAX_PENDING = 256
DEFAULT_TIME_LIMIT_S = 10.0
MIN_PROMPT_CHARS = 1 << 20
CHARS_PER_TOKEN_BOUND = 32  # a rendered prompt longer than this per context token is refused


class RenderLimitError(ValueError):
    """A render or tokenize job ran past its time limit, or its prompt past the size limit."""


class RenderPoolFull(RuntimeError):
    """`max_pending` jobs wait already: the caller answers 429 with Retry-After."""


class _Interrupted(BaseException):
    """Raised in a job's thread by the watchdog (a BaseException: no `except Exception` in
    template or library code may swallow it)."""


def _raise_in_thread(ident: int, exc: type[BaseException] | None) -> None:
    """Ask CPython to raise `exc` in thread `ident` at its next bytecode (None clears a
    pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc) if exc is not None else None
    )


@dataclass(slots=True, eq=False)
class _Job:
    deadline: float
    thread: int
    interrupted: bool = False


def _untimed(fn: Callable[[], T], what: str) -> T:
    return fn()


def max_prompt_chars(max_model_len: int) -> int:
    """The longest rendered prompt accepted for a model with this context."""
    return max(MIN_PROMPT_CHARS, CHARS_PER_TOKEN_BOUND * max_model_len)


class RenderPool:
    """Runs render and tokenize jobs; `run` is awaited from the event loop."""

    def __init__(self, workers: int = DEFAULT_WORKERS, max_pending: int = DEFAULT_MAX_PENDING,
                 time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> None:
        if workers < 1 or max_pending < 1 or time_limit_s <= 0:
            raise ValueError(f"RenderPool(workers={workers}, max_pending={max_pending}, "
                             f"time_limit_s={time_limit_s}): each must be positive")
        self.workers = workers
        self.max_pending = max_pending
        self.time_limit_s = time_limit_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenmill-render")
        self._cond = threading.Condition()
        self._running: set[_Job] = set()
        self._pending = 0  # submitted, not finished (guarded by _cond)
        self._closed = False
        self._watchdog = threading.Thread(target=self._watch, name="tokenmill-render-watchdog",
                                          daemon=True)
        self._watchdog.start()

    async def run(self, fn: Callable[[], T], what: str = "rendering the prompt",
                  timed: bool = True) -> T:
        """`fn()` on the pool. Raises RenderPoolFull when `max_pending` jobs already wait,
        RenderLimitError when a `timed` job runs past the time limit (`what` names the
        work). Untimed jobs are the ones bounded by their input alone (tokenizing and
        detokenizing a body of at most 4 MiB): a template's loop is what needs the limit."""
        with self._cond:
            if self._pending >= self.max_pending:
                raise RenderPoolFull(f"the server is busy: {self._pending} prompts wait to be "
                                     "rendered or tokenized; retry shortly")
            self._pending += 1
        try:
            job = self._run if timed else _untimed
            return await asyncio.wrap_future(self._pool.submit(job, fn, what))
        finally:
            with self._cond:
                self._pending -= 1

    def _run(self, fn: Callable[[], T], what: str) -> T:
        ident = threading.get_ident()
        job = _Job(time.monotonic() + self.time_limit_s, ident)
        try:
            with self._cond:
                self._running.add(job)
                self._cond.notify()
            try:
                return fn()
            finally:
                with self._cond:
                    self._running.discard(job)
                    if job.interrupted:  # raised already, or cleared here before it is
                        _raise_in_thread(ident, None)
        except _Interrupted:
            raise RenderLimitError(f"{what} took longer than {self.time_limit_s:g} s, the "
                                   "limit; shorten the conversation or simplify the template"
                                   ) from None

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for job in self._running:
                    if not job.interrupted and job.deadline <= now:
                        job.interrupted = True
                        _raise_in_thread(job.thread, _Interrupted)
                waiting = [j.deadline for j in self._running if not j.interrupted]
                self._cond.wait(min(waiting) - now if waiting else None)

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._pool.shutdown(wait=False, cancel_futures=True)
