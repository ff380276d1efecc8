"""The "mp" executor: one worker process per rank on this host.

Processes start with the spawn method (no forked device state). Calls go out over ZMQ:
each rank has a PUSH socket of its own (every rank gets the same msgpack bytes: a
broadcast), and replies come back on one PULL socket, tagged with the call's id and the
rank; `unique_reply_rank` makes the other ranks stay silent (steps: only the output
rank returns a result). Steps may be in flight several at once (`submit` / `collect`,
pipeline parallel); a reply for one that is not being collected yet is kept for it.
Everything on the wire is a msgspec Struct; nothing is pickled but the spawn arguments
(bytes, ints and strings).

A monitor thread waits on the processes' sentinels: when a worker exits outside
`shutdown`, the executor records a `WorkerDiedError` naming its rank, pid and exit code;
a call in flight sees it within `_POLL_S` and raises it, `check_health` raises it from
then on. A worker whose engine process is gone exits on its own.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
import traceback
import weakref
from typing import Any

import msgspec
import zmq
from tqdm import tqdm  # the base class: every subclass (auto, asyncio) shares its lock

from tokenmill.distributed.errors import ExecutorError, WorkerCallError, WorkerDiedError
from tokenmill.distributed.executor import Executor, check_step_result
from tokenmill.engine.config import EngineConfig
from tokenmill.platforms.step import StepDescription, StepResult

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a waiting call looks at the workers' health
_PARENT_CHECK_S = 1.0  # how often an idle worker checks that its engine still lives
_JOIN_S = 5.0  # how long shutdown waits for a worker before it is killed

Scalar = int | float | str | bool | None


# ---- wire messages -----------------------------------------------------------------------
class Call(msgspec.Struct, tag="call"):
    call_id: int
    method: str  # a Worker method
    args: list[Scalar]
    reply_rank: int | None  # None: every rank replies


class ExecuteCall(msgspec.Struct, tag="execute"):
    call_id: int
    step: StepDescription
    reply_rank: int | None


class ShutdownCall(msgspec.Struct, tag="shutdown"):
    call_id: int


class Reply(msgspec.Struct, tag="reply"):
    call_id: int
    rank: int
    value: Scalar


class BlobReply(msgspec.Struct, tag="blob"):
    """A method's bytes (a msgspec-encoded Struct, e.g. the KV offload's TierIndex)."""

    call_id: int
    rank: int
    value: bytes


class StepReply(msgspec.Struct, tag="step"):
    call_id: int
    rank: int
    result: StepResult | None


class ErrorReply(msgspec.Struct, tag="error"):
    call_id: int
    rank: int
    method: str
    error: str  # the worker's traceback


Request = Call | ExecuteCall | ShutdownCall
Response = Reply | BlobReply | StepReply | ErrorReply


# ---- the engine's side ---------------------------------------------------------------------
class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Response)
        self._call_ids = 0
        self._in_flight: set[int] = set()  # submitted steps not yet collected
        self._early: dict[int, list[Response]] = {}  # their replies that came first
        self._failure: ExecutorError | None = None
        self._stopping = threading.Event()
        self._reap_lock = threading.Lock()  # the monitor and shutdown both reap (_reap)
        self._dir = tempfile.mkdtemp(prefix="tokenmill-mp-")
        self._zmq = zmq.Context()
        self._replies = self._zmq.socket(zmq.PULL)
        reply_addr = f"ipc://{self._dir}/replies"
        self._replies.bind(reply_addr)
        self._inboxes: list[zmq.Socket] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        spawn = multiprocessing.get_context("spawn")
        config_bytes = msgspec.msgpack.encode(config)
        for rank in range(config.parallel.world_size):
            inbox = self._zmq.socket(zmq.PUSH)
            step_addr = f"ipc://{self._dir}/rank{rank}"
            inbox.bind(step_addr)
            self._inboxes.append(inbox)
            process = spawn.Process(
                target=worker_main,
                args=(config_bytes, rank, step_addr, reply_addr, os.getpid()),
                name=f"tokenmill-worker-{rank}",
                daemon=True,
            )
            process.start()
            self.processes.append(process)
        logger.info("mp executor: started workers %s", self.pids)
        self._monitor = threading.Thread(
            target=self._watch, name="tokenmill-worker-monitor", daemon=True
        )
        self._monitor.start()
        self._finalizer = weakref.finalize(
            self, _stop_processes, self.processes, self._zmq, self._dir, self._reap_lock
        )

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.processes]

    def collective_rpc(self, method, args=(), unique_reply_rank=None, timeout_s=None):
        call_id = self._send(method, args, unique_reply_rank)
        ranks = range(len(self.processes)) if unique_reply_rank is None else [unique_reply_rank]
        return self._gather(call_id, method, set(ranks), timeout_s)

    def submit(self, step: StepDescription) -> int:
        """Send `step` to every rank and return at once: the handle is the call's id."""
        call_id = self._send("execute", (step,), self.config.output_rank)
        self._in_flight.add(call_id)
        return call_id

    def collect(self, handle: int) -> StepResult:
        try:
            (result,) = self._gather(handle, "execute", {self.config.output_rank}, None)
        finally:
            self._in_flight.discard(handle)
        return check_step_result(result, self.config.output_rank)

    def _send(self, method: str, args: tuple, reply_rank: int | None) -> int:
        self.check_health()
        self._call_ids += 1
        call_id = self._call_ids
        if method == "execute":
            message: Request = ExecuteCall(call_id, args[0], reply_rank)
        else:
            message = Call(call_id, method, list(args), reply_rank)
        data = self._encoder.encode(message)
        for inbox in self._inboxes:
            inbox.send(data, copy=False)
        return call_id

    def _gather(
        self, call_id: int, method: str, ranks: set[int], timeout_s: float | None
    ) -> list[Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        values: dict[int, Any] = {}
        early = self._early.pop(call_id, [])
        while len(values) < len(ranks):
            if early:
                reply = early.pop(0)
            elif not self._replies.poll(int(_POLL_S * 1000)):
                self.check_health()
                if deadline is not None and time.monotonic() > deadline:
                    missing = sorted(ranks - values.keys())
                    raise ExecutorError(f"workers {missing} did not answer {method} in {timeout_s} s")
                continue
            else:
                reply = self._decoder.decode(self._replies.recv())
            if reply.call_id != call_id:
                if reply.call_id in self._in_flight:  # another step in flight: kept for it
                    self._early.setdefault(reply.call_id, []).append(reply)
                continue  # else the answer to an earlier call that raised before it arrived
            if isinstance(reply, ErrorReply):
                raise WorkerCallError(reply.rank, reply.method, reply.error)
            values[reply.rank] = reply.result if isinstance(reply, StepReply) else reply.value
        return [values[rank] for rank in sorted(ranks)]

    def check_health(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _watch(self) -> None:
        """Record the first worker that exits while the executor is not shutting down."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping.is_set():
            return
        rank = sentinels[ready[0]]
        process = self.processes[rank]
        _reap(process, self._reap_lock, 1.0)  # the exit code is known once it is reaped
        self._failure = WorkerDiedError(rank, process.pid, process.exitcode)
        logger.error("%s", self._failure)

    def shutdown(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        data = self._encoder.encode(ShutdownCall(0))
        for inbox, process in zip(self._inboxes, self.processes):
            try:
                inbox.send(data, flags=zmq.NOBLOCK)
            except zmq.Again:  # no peer: the worker is gone or going; the join below kills
                logger.info("worker %s is not connected; not asked to stop", process.pid)
        self._finalizer()


def _reap(process: multiprocessing.process.BaseProcess, lock: threading.Lock,
          timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `process` to exit; True once it has and is reaped. The
    reaping is under `lock`: two threads joining one process race in waitpid, and the
    loser's join returns with the process still looking alive."""
    if not multiprocessing.connection.wait([process.sentinel], timeout_s):
        return False
    with lock:
        process.join()  # it has exited (its sentinel is ready): only reaps it
    return True


def _stop_processes(
    processes: list[multiprocessing.process.BaseProcess], context: zmq.Context, folder: str,
    lock: threading.Lock,
) -> None:
    """Join the workers (killing those that do not stop), close the sockets, remove the
    socket folder. Also runs when the executor is collected without a shutdown."""
    deadline = time.monotonic() + _JOIN_S
    for process in processes:
        if _reap(process, lock, max(0.0, deadline - time.monotonic())):
            continue
        logger.warning("worker %s did not stop in %s s; killing it", process.pid, _JOIN_S)
        with lock:  # not reaped in between: its pid cannot have been reused
            if process.exitcode is None:
                process.kill()
        _reap(process, lock, _JOIN_S)
    context.destroy(linger=0)
    shutil.rmtree(folder, ignore_errors=True)


# ---- the worker's side ---------------------------------------------------------------------
def worker_main(
    config_bytes: bytes, rank: int, step_addr: str, reply_addr: str, parent_pid: int
) -> None:
    """A worker process: build the Worker, then answer calls until shutdown."""
    from tokenmill.distributed.worker import Worker  # imports torch: in the child only

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker{rank} %(levelname)s %(message)s")
    tqdm.set_lock(threading.RLock())  # not a named semaphore, which os._exit would leak
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(step_addr)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(reply_addr)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(Request)
    share_host_cores(config.parallel.world_size, rank)
    worker = Worker(config, rank)
    try:
        _serve(worker, rank, inbox, outbox, encoder, decoder, parent_pid)
    finally:
        worker.shutdown()
        context.destroy(linger=0)  # every reply was read: the engine waits for them
    # Everything is released and every reply sent; the interpreter's own teardown hung
    # for seconds in native code (torch / gloo destructors) and the engine then killed
    # the worker after _JOIN_S, so a clean stop exits at once.
    logging.shutdown()
    os._exit(0)


# set in a replica's engine process by `serve -dp N` (engine processes on one host): N
HOST_REPLICAS_ENV = "TOKENMILL_HOST_REPLICAS"


def share_host_cores(local_ranks: int, rank: int) -> int:
    """This executor's ranks all run on this host: each takes its share of the cores as
    torch's intra-op threads and returns the count. torch starts one thread a core in
    every process, so two ranks on two cores run four threads, and each parallel region
    of a rank waits for a thread whose core the other rank holds (a scheduler slice):
    tp2 decode steps measured 3.5x and pp2 1.7x slower than with one thread a rank
    (docs/planner.md, run 5). The ranks of every data-parallel replica on the host share
    it too ($TOKENMILL_HOST_REPLICAS, which `serve -dp N` sets for its engine processes).
    OMP_NUM_THREADS, when set, wins (torch read it)."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    replicas = max(int(os.environ.get(HOST_REPLICAS_ENV) or 1), 1)
    sharing = max(local_ranks, 1) * replicas
    threads = max(1, cores // sharing)
    if threads < torch.get_num_threads():
        torch.set_num_threads(threads)
        logger.info("rank %d: %d intra-op threads (%d cores shared by %d ranks on this host; "
                    "OMP_NUM_THREADS to choose)", rank, threads, cores, sharing)
    return torch.get_num_threads()


def _serve(worker: Any, rank: int, inbox: zmq.Socket, outbox: zmq.Socket,
           encoder: msgspec.msgpack.Encoder, decoder: msgspec.msgpack.Decoder,
           parent_pid: int) -> None:
    """Answer calls until shutdown or until the engine process is gone."""
    while True:
        if not inbox.poll(int(_PARENT_CHECK_S * 1000)):
            if os.getppid() != parent_pid:
                logger.error("the engine process %d is gone; worker %d exits", parent_pid, rank)
                return
            continue
        message = decoder.decode(inbox.recv())
        if isinstance(message, ShutdownCall):
            return
        reply = _answer(worker, rank, message)
        if message.reply_rank is None or message.reply_rank == rank:
            outbox.send(encoder.encode(reply))
        elif isinstance(reply, ErrorReply):
            # nobody reads this rank's answer: dying is how it reports (the engine's
            # monitor sees the exit code), rather than going on out of step
            logger.error("worker %d failed in %s:\n%s", rank, reply.method, reply.error)
            raise SystemExit(1)


def _answer(worker: Any, rank: int, message: Call | ExecuteCall) -> Response:
    method = "execute" if isinstance(message, ExecuteCall) else message.method
    try:
        if isinstance(message, ExecuteCall):
            return StepReply(message.call_id, rank, worker.execute(message.step))
        value = getattr(worker, message.method)(*message.args)
        if isinstance(value, bytes):
            return BlobReply(message.call_id, rank, value)
        return Reply(message.call_id, rank, value)
    except Exception:  # noqa: BLE001 - reported to the engine, which stops: never swallowed
        return ErrorReply(message.call_id, rank, method, traceback.format_exc())
