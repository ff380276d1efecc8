"""`AsyncLLM`: the frontend of an engine core, behind an asyncio server.

The frontend tokenizes, applies chat templates, validates requests, fans n > 1 out into
sequences, and turns the engine core's per-step deltas into text (incremental
detokenization, stop strings) and cumulative `RequestOutput`s. The engine core
(scheduler + model) runs either on a thread of this process or, with
`engine_process=True` (what `tokenmill serve` uses), in a process of its own; see
core/frontend/engine_core_client.py. Outputs are processed on the client's thread and handed to
each request's event loop in one call per step, so the event loop never runs a model step
or a detokenizer, and tokenization runs in worker threads.

Contract:
- `generate` yields cumulative `RequestOutput`s; the last has `finished=True`. Leaving the
  iterator early (client disconnect, `aclose`, cancellation) aborts the request and frees
  its KV blocks in the engine core.
- A bad request raises `ValueError` from `generate` before any output; an invalid
  structured output constraint raises its subclass `StructuredOutputError`, compiled in a
  worker thread before the request reaches the engine core. What only the engine core can
  refuse comes back as the same errors.
- If the engine core crashes or its process dies, the engine is dead: every in-flight and
  later request raises `EngineDeadError` instead of hanging, and `is_dead` turns true.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jinja2
import msgspec

from tokenmill.engine.config import EngineArgs
from tokenmill.engine.llm_engine import EngineDeadError, EngineSleepingError, LLMEngine
from tokenmill.frontend.engine_core_client import EngineCoreProcClient, InprocClient
from tokenmill.frontend.output_processor import OutputProcessor, check_prompt
from tokenmill.frontend.outputs import EngineCoreOutputs, RequestOutput, SchedulerStats
from tokenmill.frontend.tokenizing import apply_chat_template
from tokenmill.kv_connector.handover.messages import HandoverIn
from tokenmill.platforms.kv_handover import EngineEndpoint
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sleep_mode import check_level

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStats", "StatsObserver"]

# The engine core's state after a step, as /metrics reads it.
EngineStats = SchedulerStats


class StatsObserver(Protocol):
    """Receives per-request timings from the output thread (e.g. Prometheus metrics)."""

    def on_first_token(self, ttft_s: float) -> None: ...

    def on_next_tokens(self, inter_token_s: float, num_tokens: int) -> None: ...

    def on_finished(self, output: RequestOutput, e2e_s: float) -> None: ...


@dataclass(slots=True)
class _Tracked:
    """One request in flight: where its outputs go, and its timings."""

    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    last_time: float = 0.0
    num_generated: int = 0


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)


class AsyncLLM:
    """A frontend over an engine core. Give `EngineArgs` (the core is built here: on a
    thread, or in its own process with `engine_process=True`) or an already built
    `LLMEngine` (run on a thread)."""

    def __init__(
        self,
        args: EngineArgs | None = None,
        engine: LLMEngine | None = None,
        observer: StatsObserver | None = None,
        registry=None,
        engine_process: bool = False,
    ) -> None:
        if (args is None) == (engine is None):
            raise ValueError("give AsyncLLM either EngineArgs or an already built LLMEngine")
        if engine_process and (engine is not None or registry is not None):
            raise ValueError(
                "engine_process=True builds the engine in its own process from EngineArgs and "
                "installed plugins; it takes no LLMEngine and no registry"
            )
        self.engine: LLMEngine | None = None
        dp = args is not None and args.data_parallel_size > 1
        if engine_process:
            if dp:  # an engine process per replica (tokenmill.frontend.data_parallel)
                from tokenmill.frontend.data_parallel import DataParallelClient

                self._client = DataParallelClient.in_processes(args)
            else:
                self._client = EngineCoreProcClient(args)
            self._init_frontend_for_process(args, self._client)
        else:
            if dp:  # an engine thread per replica; self.engine is the first replica
                from tokenmill.frontend.data_parallel import DataParallelClient

                self._client = DataParallelClient.in_threads(args, registry)
                self.engine = self._client.engines[0]
            else:
                self.engine = engine if engine is not None else LLMEngine(args, registry)
                self._client = InprocClient(self.engine)
            self.args = args if dp else self.engine.args
            self.tokenizer = self.engine.tokenizer
            self.max_model_len = self.engine.max_model_len
            self.vocab_size = self.engine.loaded.hf_config.vocab_size
            self.eos_token_ids = frozenset(self.engine.loaded.eos_token_ids)
            self.chat_template = self.args.chat_template or self.engine.loaded.chat_template
            self.structured = self.engine.structured
            self.kv_endpoint = (self.engine.handover.endpoint()
                                if getattr(self.engine, "handover", None) is not None else None)
        self.observer = observer
        self.stats = EngineStats()
        self.error: BaseException | None = None
        self.outputs = OutputProcessor(self.tokenizer)
        self._lock = threading.Lock()  # guards outputs, _tracked and _closed
        self._tracked: dict[str, _Tracked] = {}
        self._closed = False
        self._started = False
        self._next_id = 0
        self.sleep_level = 0  # sleep mode: 0 awake, else the level (set before the core acts)

    def _init_frontend_for_process(self, args: EngineArgs, client: EngineCoreProcClient) -> None:
        from tokenmill.model.loader import default_model_path, load_model_info
        from tokenmill.structured.manager import StructuredOutputManager

        try:
            info = load_model_info(args.model or default_model_path(), tokenizer=args.tokenizer)
        except BaseException:
            client.shutdown()
            raise
        self.tokenizer = info.tokenizer
        ready = client.ready
        self.args = args
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = frozenset(ready.eos_token_ids)
        self.chat_template = args.chat_template or ready.chat_template
        # P/D disaggregation: how decode engines reach this engine's KV (None: off)
        self.kv_endpoint = None if ready.kv_endpoint is None else msgspec.msgpack.decode(
            ready.kv_endpoint, type=EngineEndpoint)
        # validates constraints here, so a bad one is a 400 before it reaches the core
        self.structured = StructuredOutputManager(
            self.tokenizer, ready.vocab_size, ready.eos_token_ids,
            cache_size=args.structured_output_cache_size,
            compile_timeout_s=args.structured_output_compile_timeout_s,
        )

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Start handing outputs to requests (and, in-process, the engine thread)."""
        if not self._started:
            self._started = True
            self._client.start(self._on_outputs, self._on_dead)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine core; requests still in flight fail with EngineDeadError."""
        self._client.shutdown(timeout_s)
        if not self._started:
            self._on_dead(EngineDeadError("the engine was shut down"))

    @property
    def is_dead(self) -> bool:
        return self.error is not None or self._client.is_dead

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
        template = chat_template or self.chat_template

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
        handover_out: bool = False,
        handover_in: HandoverIn | None = None,
        lease_prefix: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes. P/D disaggregation
        (LLMEngine.add_request): `handover_out` computes the prompt and one token and
        holds the KV (the last output's `kv_offer`); `handover_in` continues one;
        `lease_prefix` computes nothing: its one output's `kv_offer` leases the longest
        prefix of the prompt the engine's prefix cache holds (None: none).

        When the consumer falls behind, intermediate outputs are skipped: each one holds
        everything before it, so only the newest matters.
        """
        if self.sleep_level:
            raise EngineSleepingError(
                f"the engine is asleep (sleep level {self.sleep_level}): POST /wake_up first")
        check_prompt(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        if params.structured_outputs is not None:
            # compile (or fail) off the event loop and off the engine core; the in-process
            # core then finds the grammar in the cache
            await asyncio.to_thread(self.structured.compile, params.structured_outputs)
        params = dataclasses.replace(params, eos_token_ids=self.eos_token_ids | params.eos_token_ids)
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        tracked = _Tracked(outputs, asyncio.get_running_loop(), time.monotonic())
        with self._lock:
            if self._closed:
                raise EngineDeadError(f"the engine is dead: {self.error!r}")
            core_requests = self.outputs.add(request_id, prompt, list(prompt_token_ids), params)
            self._tracked[request_id] = tracked
        for core_request in core_requests:
            core_request.cache_salt = cache_salt
            core_request.session_id = session_id
            core_request.handover_out = handover_out
            core_request.handover_in = handover_in
            core_request.lease_prefix = lease_prefix
        finished = False
        try:
            self._client.add(core_requests)
            while not finished:
                item = await outputs.get()
                while not isinstance(item, BaseException) and not outputs.empty():
                    item = outputs.get_nowait()
                if isinstance(item, BaseException):
                    finished = True  # the request is dropped already
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._abort(request_id)

    def release(self, lease_ids: list[str]) -> None:
        """Decode engines are done with these handover leases (P/D); thread-safe."""
        self._client.release(lease_ids)

    def hint_session(self, session_id: str) -> None:
        """`session_id`'s turn ended in a tool call (LLMEngine.hint_session); thread-safe."""
        self._client.hint_session(session_id)

    # ---- sleep mode (LLMEngine.sleep) ----------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """Put the engine core to sleep (1: weights to host memory, KV discarded; 2: both
        discarded). New requests raise EngineSleepingError until `wake_up`. Raises
        ValueError for a bad level and RuntimeError when the core refuses (requests in
        flight, already asleep, no sleep mode on the platform)."""
        await self._sleep_control(check_level(level))

    async def wake_up(self) -> None:
        """Leave sleep mode; RuntimeError when the engine is not asleep."""
        await self._sleep_control(0)

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level != 0

    async def _sleep_control(self, level: int) -> None:
        if level != 0:
            self.sleep_level = level  # new requests are refused from now on
        reply = await asyncio.to_thread(self._client.sleep_control, level)
        self.sleep_level = reply.level
        if reply.error is not None:
            raise RuntimeError(reply.error)

    def _abort(self, request_id: str) -> None:
        with self._lock:
            out, core_ids = self.outputs.abort(request_id)
            tracked = self._tracked.pop(request_id, None)
        if tracked is not None and out is not None and self.observer is not None:
            self.observer.on_finished(out, time.monotonic() - tracked.arrival)
        self._client.abort(core_ids)

    # ---- the output thread (the engine thread in-process, a reader thread otherwise) -----
    def _on_outputs(self, message: EngineCoreOutputs) -> None:
        if message.stats is not None:
            self.stats = message.stats
        if not message.outputs:
            return
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            processed = self.outputs.process(message.outputs)
            for rid, error in processed.add_errors.items():
                tracked = self._tracked.pop(rid, None)
                if tracked is not None:
                    batches.setdefault(tracked.loop, []).append((tracked.outputs, error))
            for out in processed.outputs:
                tracked = self._tracked.get(out.request_id)
                if tracked is None:
                    continue
                if out.finished:
                    del self._tracked[out.request_id]
                if self.observer is not None:
                    self._observe(tracked, out, now)
                batches.setdefault(tracked.loop, []).append((tracked.outputs, out))
        self._client.abort(processed.abort_ids)
        self._hand_over(batches)

    @staticmethod
    def _hand_over(batches: dict[asyncio.AbstractEventLoop, list]) -> None:
        """One wake-up per event loop per step, however many requests it serves."""
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody is left to tell
                pass

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

    def _on_dead(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(
            f"the engine stopped: {error!r}"
        )
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            self._closed = True
            for tracked in self._tracked.values():
                batches.setdefault(tracked.loop, []).append((tracked.outputs, dead))
            self._tracked.clear()
        self._hand_over(batches)
