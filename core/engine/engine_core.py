"""The engine core in a process of its own: `tokenmill serve`'s step loop.

The API server process starts `run_engine_core` with multiprocessing's spawn context and
talks to it over two ZMQ PUSH/PULL sockets on ipc:// paths; every message is a msgspec
struct from `tokenmill.frontend.outputs` encoded with msgpack (never pickle):

    frontend -> core   EngineArgs as JSON (first message), then EngineCoreRequest /
                       EngineCoreAbort / EngineCoreShutdown
    core -> frontend   EngineCoreReady or EngineCoreDead (once, after loading), then one
                       EngineCoreOutputs per step that changed a sequence, EngineCoreDead
                       if the step loop fails

The step loop runs on the process's main thread (OpenMP regions started from another
thread ran ~35% slower on CPU, see docs/benchmarks-peers.md). It checks its input between
steps without blocking while requests run, and sleeps on it when idle. It exits on
EngineCoreShutdown, when its parent process is gone, or after reporting a failure; the
exit skips the interpreter's teardown (`_exit`), so a stop takes the engine's own
shutdown and no more.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import NoReturn

import msgspec
import zmq
from tqdm import tqdm  # the base class: every subclass (auto, asyncio) shares its lock

from tokenmill.engine.llm_engine import EngineSleepingError
from tokenmill.frontend.output_processor import add_error_kind
from tokenmill.frontend.outputs import (
    EngineCoreAbort,
    EngineCoreDead,
    EngineCoreInput,
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

# How long the idle loop sleeps on its input before checking that its parent still lives.
_IDLE_POLL_MS = 500


@dataclass(frozen=True, slots=True)
class EngineCoreAddresses:
    """Where the two sockets live; the frontend binds them, the engine core connects."""

    inputs: str  # frontend PUSH -> core PULL
    outputs: str  # core PUSH -> frontend PULL


def run_engine_core(inputs: str, outputs: str, parent_pid: int, log_level: int,
                    host_replicas: int = 1) -> None:
    """The engine process's entry point (spawned by `EngineCoreProcClient`). With
    `host_replicas` > 1 it is one of that many replicas on this host: it and its workers
    take their share of the cores (`share_host_cores`)."""
    # Ctrl-C reaches the whole process group; the API server drains its requests first
    # and then tells this process to stop, so SIGINT must not end it early.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    # progress bars (GGUF loading) lock with a thread lock: tqdm's default is a named
    # semaphore, which this process's `_exit` never unlinks (a "leaked semaphore" warning)
    tqdm.set_lock(threading.RLock())
    if host_replicas > 1:
        from tokenmill.distributed.mp import HOST_REPLICAS_ENV, share_host_cores

        os.environ[HOST_REPLICAS_ENV] = str(host_replicas)  # the workers it starts read it
        share_host_cores(1, 0)
    ctx = zmq.Context(io_threads=1)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(inputs)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.connect(outputs)
    encoder = msgspec.msgpack.Encoder()
    try:
        engine = _build_engine(in_sock)
    except (FileNotFoundError, ValueError) as e:  # what the user gave: the frontend says it once
        logger.debug("the engine failed to start", exc_info=True)
        _report_failure(ctx, out_sock, in_sock, f"the engine failed to start: {e}")
    except BaseException as e:  # noqa: BLE001 - the frontend must learn why, then we exit
        logger.exception("the engine failed to start")
        _report_failure(ctx, out_sock, in_sock, f"the engine failed to start: {e!r}")
    out_sock.send(encoder.encode(EngineCoreReady(
        max_model_len=engine.max_model_len,
        vocab_size=engine.loaded.hf_config.vocab_size,
        eos_token_ids=sorted(engine.loaded.eos_token_ids),
        chat_template=engine.loaded.chat_template,
        kv_endpoint=None if engine.handover is None
        else msgspec.msgpack.encode(engine.handover.endpoint()),
    )))
    try:
        code = EngineCoreLoop(engine, in_sock, out_sock, parent_pid).run()
    finally:
        engine.shutdown()  # the workers (their processes, with the "mp" executor)
        _close(ctx, out_sock, in_sock)
    _exit(code)


def _build_engine(in_sock: zmq.Socket):
    from tokenmill.engine.config import EngineArgs
    from tokenmill.engine.llm_engine import LLMEngine

    args = EngineArgs.model_validate_json(in_sock.recv())
    return LLMEngine(args)


def _report_failure(ctx: zmq.Context, out_sock: zmq.Socket, in_sock: zmq.Socket,
                    error: str) -> NoReturn:
    out_sock.send(msgspec.msgpack.encode(EngineCoreDead(error)))
    _close(ctx, out_sock, in_sock)
    _exit(1)


def _close(ctx: zmq.Context, out_sock: zmq.Socket, in_sock: zmq.Socket) -> None:
    out_sock.close(linger=2000)  # let the last message (a failure report) leave
    in_sock.close(linger=0)
    ctx.term()


def _exit(code: int) -> NoReturn:
    """End the process now: the engine and its workers are shut down and every message
    is sent. The interpreter's own teardown (a full collection of torch's, transformers'
    and the model's objects) took 2.5 s on an idle core and over 10 s on a loaded one, so
    a replica asked to stop was SIGTERMed by its front instead of exiting (serve -dp)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def check_failed(engine) -> None:
    """Raise EngineDeadError once the engine's workers have failed (their requests were
    just failed in the last deltas): the core cannot serve anything more."""
    if engine.failure is not None:
        engine.check_health()


def apply_sleep(engine, message: EngineCoreSleep) -> EngineCoreSleepState:
    """Carry out a sleep-mode change on the engine; the reply names the refusal, if any
    (the engine keeps serving either way)."""
    try:
        if message.level == 0:
            engine.wake_up()
        else:
            engine.sleep(message.level)
    except (ValueError, RuntimeError) as e:
        return EngineCoreSleepState(engine.sleep_level, str(e))
    return EngineCoreSleepState(engine.sleep_level)


class _Orphaned(Exception):
    """The API server process exited; nobody reads this engine's outputs."""


class EngineCoreLoop:
    """The step loop over an `LLMEngine`, fed by and reporting to the frontend's sockets."""

    def __init__(self, engine, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int):
        self.engine = engine
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_pid = parent_pid
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreInput)
        self._pending: list[EngineCoreOutput] = []  # add errors, sent with the next message
        self._stopping = False

    def run(self) -> int:
        """Serve until shutdown (0), or report the failure that ended the loop (1)."""
        engine = self.engine
        was_busy = False
        if getattr(engine, "handover", None) is not None:
            self._send([])  # the frontend's handover gauges start at zero, not absent
        try:
            while not self._stopping:
                busy = engine.has_unfinished_requests()
                if self.in_sock.poll(0 if busy else _IDLE_POLL_MS):
                    self._drain_inputs()
                elif not busy:
                    if os.getppid() != self.parent_pid:
                        logger.warning("the API server process is gone; the engine exits")
                        return 0
                    engine.check_health()  # a worker that died while idle ends the core
                if self._stopping:
                    break
                if engine.has_unfinished_requests():
                    deltas = engine.core_step()
                    was_busy = True
                    if deltas or self._pending:
                        self._send(deltas)
                    check_failed(engine)
                elif was_busy or self._pending:  # went idle: the frontend's gauges catch up
                    was_busy = False
                    self._send([])
        except _Orphaned:
            logger.warning("the API server process is gone; the engine exits")
            return 0
        except BaseException as e:  # noqa: BLE001 - the frontend must fail every request
            logger.exception("the engine step loop failed; the engine process exits")
            try:
                self.out_sock.send(
                    self.encoder.encode(EngineCoreDead(f"the engine failed: {e!r}")), zmq.NOBLOCK
                )
            except zmq.Again:
                pass  # nobody is listening; exiting is all that is left
            return 1
        return 0

    def _send(self, deltas: list[EngineCoreOutput]) -> None:
        if self._pending:
            deltas = self._pending + deltas
            self._pending = []
        message = EngineCoreOutputs(deltas, self.engine.scheduler_stats())
        self._send_bytes(self.encoder.encode(message))

    def _send_bytes(self, data: bytes) -> None:
        """A PUSH socket whose peer is gone blocks forever; wait in short polls instead,
        and give up when the API server process is gone."""
        while True:
            try:
                self.out_sock.send(data, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if os.getppid() != self.parent_pid:
                    raise _Orphaned() from None
                self.out_sock.poll(100, zmq.POLLOUT)

    def _drain_inputs(self) -> None:
        while True:
            try:
                raw = self.in_sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = self.decoder.decode(raw.buffer)
            if isinstance(message, EngineCoreRequest):
                self._add(message)
            elif isinstance(message, EngineCoreAbort):
                self.engine.abort_core_requests(message.request_ids)
            elif isinstance(message, EngineCoreSessionHint):
                self.engine.hint_session(message.session_id)
            elif isinstance(message, EngineCoreRelease):
                if self.engine.release_handover(message.lease_ids):
                    self._send([])  # the frontend's lease gauge catches up
            elif isinstance(message, EngineCoreSleep):
                self._send_bytes(self.encoder.encode(apply_sleep(self.engine, message)))
            elif isinstance(message, EngineCoreShutdown):
                self._stopping = True
                return

    def _add(self, request: EngineCoreRequest) -> None:
        try:
            self.engine.add_core_request(request)
        except (ValueError, EngineSleepingError) as e:  # this request only: a 400 / 503
            self._pending.append(EngineCoreOutput(
                request.request_id, finish_reason="error", stop_reason=str(e),
                add_error=add_error_kind(e),
            ))
