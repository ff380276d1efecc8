"""How a frontend (`AsyncLLM`) talks to an engine core: in a thread of this process, or in
a process of its own (`tokenmill serve`). Both take the same messages and hand back the
same per-step `EngineCoreOutputs`, so the frontend does not know which it has.

Contract of a client:
- `start(on_outputs, on_dead)`: from then on `on_outputs(EngineCoreOutputs)` is called for
  every step that changed a sequence (and when the core goes idle), from one thread of the
  client's own; `on_dead(error)` is called once, from that thread, when the core stops
  (shut down, crashed, or its process died). Neither is called after `on_dead`.
- `add` / `abort` queue work for the core; `add` raises EngineDeadError once the core is
  gone. Engine-side add errors come back as deltas with `add_error` set.
- `shutdown()` stops the core and waits for `on_dead`.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec
import zmq

from tokenmill.engine.engine_core import (
    EngineCoreAddresses,
    apply_sleep,
    check_failed,
    run_engine_core,
)
from tokenmill.engine.llm_engine import EngineDeadError, EngineSleepingError
from tokenmill.frontend.output_processor import add_error_kind
from tokenmill.frontend.outputs import (
    EngineCoreAbort,
    EngineCoreDead,
    EngineCoreInput,
    EngineCoreMessage,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRelease,
    EngineCoreRequest,
    EngineCoreSessionHint,
    EngineCoreShutdown,
    EngineCoreSleep,
    EngineCoreSleepState,
)

logger = logging.getLogger(__name__)

OnOutputs = Callable[[EngineCoreOutputs], None]
OnDead = Callable[[BaseException], None]

# How long the idle engine thread sleeps on its inbox before checking for shutdown.
_IDLE_WAIT_S = 0.05
# How long the busy engine thread waits for new requests after a step with no output.
_NO_OUTPUT_WAIT_S = 0.001


@dataclass(slots=True)
class _SleepCall:
    """A sleep-mode change for the engine thread, and where its reply goes."""

    message: EngineCoreSleep
    reply: Future


class InprocClient:
    """The engine core on a thread of this process (tests, embedding in an app)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[EngineCoreInput] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._on_outputs: OnOutputs | None = None
        self._on_dead: OnDead | None = None

    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        if self._thread is not None:
            return
        self._on_outputs, self._on_dead = on_outputs, on_dead
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    @property
    def is_dead(self) -> bool:
        return self._closed or (self._thread is not None and not self._thread.is_alive())

    def add(self, requests: list[EngineCoreRequest]) -> None:
        with self._lock:  # the engine thread cannot stop between the check and the put
            if self._closed:
                raise EngineDeadError("the engine is dead")
            for request in requests:
                self._inbox.put(request)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._inbox.put(EngineCoreAbort(request_ids))

    def hint_session(self, session_id: str) -> None:
        """The session's turn ended in a tool call (LLMEngine.hint_session)."""
        self._inbox.put(EngineCoreSessionHint(session_id))

    def release(self, lease_ids: list[str]) -> None:
        """Decode engines are done with these handover leases (LLMEngine.release_handover)."""
        if lease_ids:
            self._inbox.put(EngineCoreRelease(lease_ids))

    def sleep_control(self, level: int, timeout_s: float = 600.0) -> EngineCoreSleepState:
        """Sleep at `level` (0: wake up) between two steps of the engine thread; blocks
        until it is done and returns the core's reply."""
        call = _SleepCall(EngineCoreSleep(level), Future())
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine is dead")
            self._inbox.put(call)
        return call.reply.result(timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._inbox.put(EngineCoreShutdown())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        engine = self.engine
        error: BaseException = EngineDeadError("the engine was shut down")
        pending: list[EngineCoreOutput] = []
        try:
            deltas: list[EngineCoreOutput] = []
            was_busy = False
            while True:
                busy = engine.has_unfinished_requests()
                # a step with no output (a prefill chunk, nothing schedulable) lets new
                # requests in with a short wait rather than spinning on the GIL
                wait_s = (0.0 if deltas else _NO_OUTPUT_WAIT_S) if busy else _IDLE_WAIT_S
                if not self._drain(wait_s, pending):
                    break
                if not busy:
                    engine.check_health()  # a worker that died while idle ends the core
                deltas = engine.core_step() if engine.has_unfinished_requests() else []
                if deltas or pending or (was_busy and not engine.has_unfinished_requests()):
                    self._on_outputs(EngineCoreOutputs(pending + deltas, engine.scheduler_stats()))
                    pending = []
                check_failed(engine)
                was_busy = engine.has_unfinished_requests()
        except BaseException as e:  # noqa: BLE001 - every in-flight request must learn of it
            logger.exception("the engine thread crashed; the engine is now dead")
            error = e
        with self._lock:
            self._closed = True
        self._on_dead(error)

    def _drain(self, wait_s: float, pending: list[EngineCoreOutput]) -> bool:
        """Apply queued messages; False on shutdown."""
        try:
            item = self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(item, EngineCoreRequest):
                try:
                    self.engine.add_core_request(item)
                except (ValueError, EngineSleepingError) as e:
                    pending.append(EngineCoreOutput(
                        item.request_id, finish_reason="error", stop_reason=str(e),
                        add_error=add_error_kind(e),
                    ))
            elif isinstance(item, EngineCoreAbort):
                self.engine.abort_core_requests(item.request_ids)
            elif isinstance(item, EngineCoreSessionHint):
                self.engine.hint_session(item.session_id)
            elif isinstance(item, EngineCoreRelease):
                self.engine.release_handover(item.lease_ids)
            elif isinstance(item, _SleepCall):
                item.reply.set_result(apply_sleep(self.engine, item.message))
            else:
                return False
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True


class EngineCoreProcClient:
    """The engine core in a spawned process (see core/engine/engine_core.py), over ZMQ.

    Construction starts the process, sends it `args` and blocks until its model is loaded
    (`ready` then holds what it reported); a failed start raises RuntimeError with the
    engine's own error. A reader thread receives outputs and watches the process: if it
    exits without being asked to, every in-flight request fails at once.
    """

    def __init__(self, args, startup_timeout_s: float = 900.0, host_replicas: int = 1) -> None:
        """`host_replicas`: engine processes of this deployment on this host (`serve -dp N`
        starts N), whose ranks share its cores (`tokenmill.distributed.mp.share_host_cores`)."""
        self._dir = tempfile.mkdtemp(prefix="tokenmill-engine-")
        self.addresses = EngineCoreAddresses(
            inputs=f"ipc://{self._dir}/inputs", outputs=f"ipc://{self._dir}/outputs"
        )
        self._ctx = zmq.Context(io_threads=1)
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.bind(self.addresses.inputs)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(self.addresses.outputs)
        self._send_lock = threading.Lock()  # guards _in and _closed
        self._closed = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreMessage)
        self._stopping = threading.Event()
        self._dead = threading.Event()
        self._sleep_lock = threading.Lock()  # one sleep-mode change at a time
        self._sleep_replies: queue.Queue[EngineCoreSleepState] = queue.Queue()
        self._reader: threading.Thread | None = None
        # every waitpid on the process goes through here: two threads joining one
        # multiprocessing.Process race, and the loser's join returns with the process
        # still "alive" (its waitpid failed with ECHILD before the winner recorded the
        # exit code), which is how a stopped replica looked running (serve -dp)
        self._reap_lock = threading.Lock()
        spawn = multiprocessing.get_context("spawn")
        self.proc = spawn.Process(
            target=run_engine_core,
            args=(self.addresses.inputs, self.addresses.outputs, os.getpid(),
                  logging.getLogger("tokenmill").getEffectiveLevel(), host_replicas),
            name="tokenmill-engine-core",
        )
        self.proc.start()
        atexit.register(self.shutdown)
        self._in.send(args.model_dump_json().encode())
        self.ready = self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> EngineCoreReady:
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        events = dict(poller.poll(timeout_s * 1000))
        if self._out in events:
            message = self._decoder.decode(self._out.recv())
            if isinstance(message, EngineCoreReady):
                return message
            error = message.error if isinstance(message, EngineCoreDead) else repr(message)
        elif events:
            self.wait_exit(5)
            error = f"the engine process exited with code {self.exitcode} while starting"
        else:
            error = f"the engine process did not load its model within {timeout_s:.0f} s"
        self.shutdown()
        raise RuntimeError(error)

    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        if self._reader is not None:
            return
        self._reader = threading.Thread(
            target=self._read, args=(on_outputs, on_dead), name="tokenmill-engine-outputs",
            daemon=True,
        )
        self._reader.start()

    @property
    def is_dead(self) -> bool:
        return self._dead.is_set() or self.exitcode is not None

    @property
    def exitcode(self) -> int | None:
        """The engine process's exit code; None while it runs (thread-safe)."""
        with self._reap_lock:
            return self.proc.exitcode  # a waitpid that does not block

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the engine process to end; True once it has (and
        is reaped). Thread-safe, unlike joining `proc` from several threads."""
        if not multiprocessing.connection.wait([self.proc.sentinel], timeout_s):
            return False
        with self._reap_lock:
            self.proc.join()  # it has exited (its sentinel is ready): only reaps it
        return True

    def _signal(self, stop: Callable[[], None]) -> None:
        """Send `proc.terminate` / `proc.kill` unless the process is reaped already (the
        lock keeps its pid from being reaped, and reused, in between)."""
        with self._reap_lock:
            if self.proc.exitcode is None:
                stop()

    def add(self, requests: list[EngineCoreRequest]) -> None:
        if self.is_dead or self._stopping.is_set():
            raise EngineDeadError(
                f"the engine process is not running (exit code {self.exitcode})"
            )
        self._send(*requests)

    def abort(self, request_ids: list[str]) -> None:
        """Best effort: a dead engine holds nothing to free."""
        if request_ids and not self._dead.is_set():
            try:
                self._send(EngineCoreAbort(request_ids))
            except EngineDeadError:
                pass

    def hint_session(self, session_id: str) -> None:
        """Best effort, like `abort`: a hint only speeds up the session's next turn."""
        if not self._dead.is_set():
            try:
                self._send(EngineCoreSessionHint(session_id))
            except EngineDeadError:
                pass

    def release(self, lease_ids: list[str]) -> None:
        """Best effort, like `abort`: a dead engine holds no lease."""
        if lease_ids and not self._dead.is_set():
            try:
                self._send(EngineCoreRelease(lease_ids))
            except EngineDeadError:
                pass

    def sleep_control(self, level: int, timeout_s: float = 600.0) -> EngineCoreSleepState:
        """Sleep at `level` (0: wake up) in the engine process; blocks until it replies."""
        with self._sleep_lock:
            self._send(EngineCoreSleep(level))
            deadline = timeout_s
            while True:
                try:
                    return self._sleep_replies.get(timeout=min(deadline, 0.5))
                except queue.Empty:
                    deadline -= 0.5
                    if self.is_dead:
                        raise EngineDeadError("the engine process died during a sleep-mode "
                                              "change") from None
                    if deadline <= 0:
                        raise TimeoutError(f"no sleep-mode reply within {timeout_s:.0f} s") from None

    def _send(self, *messages) -> None:
        """Send without ever blocking on a dead engine: a PUSH socket whose peer is gone
        waits forever, so wait for room in short polls while the process lives."""
        with self._send_lock:
            for message in messages:
                data = self._encoder.encode(message)
                while True:
                    if self._closed:
                        raise EngineDeadError("the engine process is gone")
                    try:
                        self._in.send(data, zmq.NOBLOCK, copy=False)
                        break
                    except zmq.Again:
                        if self.exitcode is not None:
                            raise EngineDeadError(
                                f"the engine process died (exit code {self.exitcode})"
                            ) from None
                        self._in.poll(100, zmq.POLLOUT)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process (asking first, then SIGTERM, then SIGKILL) and the
        reader; idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        atexit.unregister(self.shutdown)
        if self.exitcode is None:
            try:
                self._send(EngineCoreShutdown())
            except (zmq.ZMQError, EngineDeadError):
                pass  # it is exiting already, or the signals below stop it
            if not self.wait_exit(timeout_s):
                self._signal(self.proc.terminate)
                if not self.wait_exit(5):
                    self._signal(self.proc.kill)
                    self.wait_exit(5)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout_s)
        if self._reader is None:
            self._close()

    def _close(self) -> None:
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            self._in.close(linger=0)
            self._out.close(linger=0)
            self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _read(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        error: BaseException | None = None
        try:
            while error is None:
                events = dict(poller.poll(100))
                if self._out in events:
                    error = self._receive(on_outputs)
                elif events:  # the process exited; nothing is left to read
                    self.wait_exit(1)
                    if self._stopping.is_set():
                        error = EngineDeadError("the engine was shut down")
                    else:
                        error = EngineDeadError(
                            f"the engine process died (exit code {self.exitcode})"
                        )
                        logger.error("%s; every request fails now", error)
                elif self._stopping.is_set() and self.exitcode is not None:
                    error = EngineDeadError("the engine was shut down")
        except BaseException as e:  # noqa: BLE001 - a bug here must still fail the requests
            logger.exception("reading the engine's outputs failed; the engine is now dead")
            error = e
        self._dead.set()
        on_dead(error)
        self._close()

    def _receive(self, on_outputs: OnOutputs) -> BaseException | None:
        """Hand on every message waiting; the error if the engine reported its failure."""
        while True:
            try:
                raw = self._out.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            message = self._decoder.decode(raw.buffer)
            if isinstance(message, EngineCoreOutputs):
                on_outputs(message)
            elif isinstance(message, EngineCoreSleepState):
                self._sleep_replies.put(message)
            elif isinstance(message, EngineCoreDead):
                logger.error("the engine process reported: %s", message.error)
                return EngineDeadError(message.error)
