"""`AsyncLLM`: the engine behind an asyncio server.

The engine is not thread-safe, so exactly one thread touches it: the engine thread, which
this class owns. Coroutines talk to it through a thread-safe inbox (add / abort) and get
outputs back on per-request asyncio queues, filled with `loop.call_soon_threadsafe`. The
event loop never runs a model step, and tokenization runs in worker threads.

Contract:
- `generate` yields cumulative `RequestOutput`s; the last has `finished=True`. Leaving the
  iterator early (client disconnect, `aclose`, cancellation) aborts the request and frees
  its KV blocks in the engine thread.
- A bad request raises `ValueError` from `generate` before any output; an invalid
  structured output constraint raises its subclass `StructuredOutputError`, compiled in a
  worker thread before the request reaches the engine thread.
- If the engine thread crashes, the engine is dead: every in-flight and later request
  raises `EngineDeadError` instead of hanging, and `is_dead` turns true.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jinja2

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizing import apply_chat_template

logger = logging.getLogger(__name__)

# How long the idle engine thread sleeps on its inbox before checking for shutdown.
_IDLE_WAIT_S = 0.05
# How long the busy engine thread waits for new requests after a step with no output.
_NO_OUTPUT_WAIT_S = 0.001


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served any more."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's state, published by the engine thread after each step."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    # KV offload: tier name -> its counters (tokenmill.kv_connector.tier.TierStats), in
    # stack order; empty without offload
    kv_tiers: dict = field(default_factory=dict)


class StatsObserver(Protocol):
    """Receives per-request timings from the engine thread (e.g. Prometheus metrics)."""

    def on_first_token(self, ttft_s: float) -> None: ...

    def on_next_tokens(self, inter_token_s: float, num_tokens: int) -> None: ...

    def on_finished(self, output: RequestOutput, e2e_s: float) -> None: ...


@dataclass(slots=True)
class _Tracked:
    """Engine-thread bookkeeping for one request."""

    deliver: Callable[[RequestOutput | BaseException], None]
    arrival: float
    last_time: float = 0.0
    num_generated: int = 0


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    cache_salt: str | None
    session_id: str | None
    deliver: Callable[[RequestOutput | BaseException], None]
    arrival: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _SessionHint:
    session_id: str  # its last turn ended in a tool call: it will be back


class AsyncLLM:
    """Owns an `LLMEngine` and runs its step loop in a dedicated thread, or, with
    `own_thread=False`, on whichever thread calls `run_forever()` (`tokenmill serve` gives it
    the process's main thread: on CPU, OpenMP regions started from a non-main thread ran
    ~35% slower, see docs/benchmarks-peers.md)."""

    def __init__(
        self,
        args: EngineArgs | None = None,
        engine: LLMEngine | None = None,
        observer: StatsObserver | None = None,
        registry=None,
        own_thread: bool = True,
    ) -> None:
        if (args is None) == (engine is None):
            raise ValueError("give AsyncLLM either EngineArgs or an already built LLMEngine")
        self.engine = engine if engine is not None else LLMEngine(args, registry)
        self.args = self.engine.args
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.observer = observer
        self.stats = EngineStats()
        self.error: BaseException | None = None
        self._inbox: queue.Queue[_Add | _Abort | _SessionHint] = queue.Queue()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closed = False  # set once by the engine thread as it exits; then no new request
        self._thread: threading.Thread | None = None
        self._own_thread = own_thread
        self._loop_done = threading.Event()  # set when the step loop has returned
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._next_id = 0

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (a no-op with own_thread=False: see `run_forever`)."""
        if self._thread is not None or not self._own_thread:
            return
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def run_forever(self) -> None:
        """Run the step loop on the calling thread until `shutdown()` is called from another
        thread. Only for AsyncLLM(own_thread=False)."""
        if self._own_thread:
            raise RuntimeError("run_forever() needs AsyncLLM(own_thread=False)")
        self._thread = threading.current_thread()
        self._run()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the step loop; requests still in flight fail with EngineDeadError."""
        self._stop.set()
        if not self._own_thread:  # the loop's thread is the caller's owner: wait, never join
            if self._thread is not None:
                self._loop_done.wait(timeout_s)
            return
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def is_dead(self) -> bool:
        return self.error is not None or (self._thread is not None and not self._thread.is_alive())

    # ---- prompts (off the event loop) ---------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await asyncio.to_thread(
            self.tokenizer.encode, text, add_special_tokens=add_special_tokens
        )

    async def decode(self, token_ids: Sequence[int]) -> str:
        return await asyncio.to_thread(self.tokenizer.decode, list(token_ids))

    async def render_chat(
        self, messages: list[dict[str, Any]], chat_template: str | None = None
    ) -> tuple[str, list[int]]:
        """Apply the chat template and tokenize, as `LLM.chat` does; returns (text, ids).

        Raises ValueError when there is no template or it refuses these messages (templates
        raise on, e.g., roles that do not alternate).
        """
        template = chat_template or self.args.chat_template or self.engine.loaded.chat_template

        def render() -> tuple[str, list[int]]:
            try:
                text = apply_chat_template(self.tokenizer, messages, template, True)
            except jinja2.TemplateError as e:
                raise ValueError(f"the chat template failed on these messages: {e}") from e
            return text, self.tokenizer.encode(text, add_special_tokens=False)

        return await asyncio.to_thread(render)

    # ---- requests ------------------------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        self._next_id += 1
        return f"{prefix}-{self._next_id}"

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes.

        When the consumer falls behind, intermediate outputs are skipped: each one holds
        everything before it, so only the newest matters.
        """
        if params.structured_outputs is not None:
            # compile (or fail) off the event loop and off the engine thread; the engine's
            # add_request then finds the grammar in the cache
            await asyncio.to_thread(self.engine.structured.compile, params.structured_outputs)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def deliver(item: RequestOutput | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is left to tell
                pass

        with self._lock:  # the engine thread cannot stop between the check and the put
            if self._closed:
                raise EngineDeadError(f"the engine is dead: {self.error!r}")
            self._inbox.put(_Add(
                request_id, prompt_token_ids, params, prompt, cache_salt, session_id, deliver
            ))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                while not isinstance(item, BaseException) and not outputs.empty():
                    item = outputs.get_nowait()
                if isinstance(item, BaseException):
                    finished = True  # the engine thread dropped the request already
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id))

    def hint_session(self, session_id: str) -> None:
        """`session_id`'s turn ended in a tool call (LLMEngine.hint_session); thread-safe."""
        self._inbox.put(_SessionHint(session_id))

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            outputs: list[RequestOutput] = []
            while not self._stop.is_set():
                if not engine.has_unfinished_requests():
                    self._drain_inbox(_IDLE_WAIT_S)
                else:
                    # a step with no output (a prefill chunk, or nothing schedulable) lets
                    # new requests in with a short wait rather than spinning on the GIL
                    self._drain_inbox(0.0 if outputs else _NO_OUTPUT_WAIT_S)
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._publish(outputs)
                self._snapshot()
        except BaseException as e:  # noqa: BLE001 - every in-flight request must learn of it
            logger.exception("the engine thread crashed; the engine is now dead")
            self.error = e
        if self.error is None:
            self.error = EngineDeadError("the engine was shut down")
        with self._lock:
            self._closed = True
        self._fail_all(EngineDeadError(f"the engine stopped: {self.error!r}"))
        self._loop_done.set()

    def _drain_inbox(self, wait_s: float) -> None:
        try:
            item = self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Add):
                self._add(item)
            elif isinstance(item, _SessionHint):
                self.engine.hint_session(item.session_id)
            else:
                self._abort(item.request_id)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(
                cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.prompt, cmd.cache_salt,
                cmd.session_id,
            )
        except ValueError as e:
            cmd.deliver(e)
            return
        self._tracked[cmd.request_id] = _Tracked(cmd.deliver, cmd.arrival)

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        out = self.engine.abort_request(request_id)
        if tracked is not None and out is not None and self.observer is not None:
            self.observer.on_finished(out, time.monotonic() - tracked.arrival)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            if self.observer is not None:
                self._observe(tracked, out, now)
            if out.finished:
                del self._tracked[out.request_id]
            tracked.deliver(out)

    def _observe(self, tracked: _Tracked, out: RequestOutput, now: float) -> None:
        num = sum(len(o.token_ids) for o in out.outputs)
        new = num - tracked.num_generated
        if new > 0:
            if tracked.num_generated == 0:
                self.observer.on_first_token(now - tracked.arrival)
            else:
                self.observer.on_next_tokens(now - tracked.last_time, new)
            tracked.num_generated, tracked.last_time = num, now
        if out.finished:
            self.observer.on_finished(out, now - tracked.arrival)

    def _snapshot(self) -> None:
        engine = self.engine
        self.stats = EngineStats(
            num_running=engine.scheduler.num_running,
            num_waiting=engine.scheduler.num_waiting,
            num_preemptions=engine.scheduler.num_preemptions,
            kv_usage=engine.kv.usage,
            prefix_cache_queries=engine.kv.stats.queries,
            prefix_cache_hits=engine.kv.stats.hits,
            kv_tiers=engine.offload.snapshot() if engine.offload is not None else {},
        )

    def _fail_all(self, error: BaseException) -> None:
        for tracked in self._tracked.values():
            tracked.deliver(error)
        self._tracked.clear()
        while True:  # requests queued before `_closed` was set
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Add):
                item.deliver(error)
