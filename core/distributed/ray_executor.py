"""The "ray" executor: one worker per rank as a Ray actor, on any node of a Ray cluster.

The engine joins the cluster Ray already knows in this process (`ray.init` called by the
caller), else `ray.init()`, which connects to `RAY_ADDRESS` when set or starts a local
cluster. The ranks get one placement-group bundle each (`TOKENMILL_RAY_WORKER_CPUS`
CPUs, default 1; strategy `TOKENMILL_RAY_PLACEMENT`, default PACK: fill a node before
the next, so TP ranks share a node when they fit and a larger world spills over hosts).
Rank 0's actor names the torch.distributed rendezvous on its own node's address, so
the ranks find each other across hosts.

What crosses to the actors is msgpack bytes of msgspec Structs (the EngineConfig, each
step, each result, the scalars of `collective_rpc`); Ray moves bytes, nothing of ours is
pickled. Steps are actor calls, which Ray runs in submission order per actor, so
`submit` returns at once and pipeline stages overlap as with "mp".

Failures: each actor also runs a `sentinel` call that never returns (in a concurrency
group of its own, beside the steps); it resolves with an error the moment the actor's
process dies. Every wait watches the sentinels, so a dead actor is noticed within
`_POLL_S` even while the other ranks block in a collective, and `check_health` reports
it while idle. A rank that raises fails the call with its traceback.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from typing import Any

import msgspec

from tokenmill.distributed.errors import ExecutorError, WorkerCallError, WorkerDiedError
from tokenmill.distributed.executor import Executor, check_step_result
from tokenmill.engine.config import EngineConfig
from tokenmill.platforms.step import StepDescription, StepResult, decode_result, decode_step, encode

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # how long one wait lasts before the sentinels are looked at again
_READY_S = 120.0  # how long the placement group may take to be placed

Scalar = int | float | str | bool | None


class _Reply(msgspec.Struct):
    value: Scalar = None
    error: str | None = None  # the rank's traceback when it raised


class RayWorker:
    """The actor: one rank's `Worker`, driven by msgpack bytes."""

    def __init__(self, config_bytes: bytes, rank: int) -> None:
        self.rank = rank
        self.config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        self.worker = None

    def rendezvous(self) -> str:
        """A torch.distributed init method on this node's address and a free port."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            return f"tcp://{host}:{probe.getsockname()[1]}"

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def start(self, init_method: str | None) -> None:
        from tokenmill.distributed.worker import Worker  # imports torch: in the actor only

        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s ray-worker{self.rank} %(levelname)s %(message)s")
        config = msgspec.structs.replace(self.config, dist_init_method=init_method)
        self.worker = Worker(config, self.rank)

    def call(self, method: str, args_bytes: bytes) -> bytes:
        try:
            args = msgspec.msgpack.decode(args_bytes, type=list[Scalar])
            value = getattr(self.worker, method)(*args)
            return msgspec.msgpack.encode(_Reply(value))
        except Exception:  # noqa: BLE001 - reported to the engine, which stops
            return msgspec.msgpack.encode(_Reply(error=traceback.format_exc()))

    def execute(self, step_bytes: bytes) -> bytes | None:
        """The step's result bytes from the output rank, None from the others; raises
        (the executor reports the traceback) when the step fails."""
        result = self.worker.execute(decode_step(step_bytes))
        return None if result is None else encode(result)

    def sentinel(self) -> None:
        """Never returns while the actor lives: its failure is the actor's death."""
        threading.Event().wait()

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(config)
        self._ray = ray
        self._failure: ExecutorError | None = None
        self._stopped = False
        self._in_flight: dict[int, list[Any]] = {}  # step handle -> every rank's ref
        self._handles = 0
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING)
        cpus = float(os.environ.get("TOKENMILL_RAY_WORKER_CPUS", "1"))
        strategy = os.environ.get("TOKENMILL_RAY_PLACEMENT", "PACK")
        self._group = placement_group([{"CPU": cpus}] * config.parallel.world_size, strategy=strategy)
        ready, _ = ray.wait([self._group.ready()], timeout=_READY_S)
        if not ready:
            ray.util.remove_placement_group(self._group)
            raise ExecutorError(
                f"Ray could not place {config.parallel.world_size} workers of {cpus} CPUs "
                f"({strategy}) in {_READY_S} s; cluster resources: {ray.cluster_resources()}"
            )
        actor_cls = ray.remote(concurrency_groups={"health": 1})(RayWorker)
        config_bytes = msgspec.msgpack.encode(config)
        self.actors = [
            actor_cls.options(
                num_cpus=cpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=rank
                ),
            ).remote(config_bytes, rank)
            for rank in range(config.parallel.world_size)
        ]
        self._sentinels = [
            a.sentinel.options(concurrency_group="health").remote() for a in self.actors
        ]
        self.locations: list[tuple[str, int | None]] = [("?", None)] * config.parallel.world_size
        self.locations = self._wait(
            [a.where.remote() for a in self.actors], "where"
        )
        init_method = None
        if config.dist_init_method is not None:  # the ranks form a torch.distributed world
            (init_method,) = self._wait([self.actors[0].rendezvous.remote()], "rendezvous")
        self._wait([a.start.remote(init_method) for a in self.actors], "start")
        logger.info("ray executor: workers on nodes %s", [n for n, _ in self.locations])

    @property
    def pids(self) -> list[int]:
        return [pid for _, pid in self.locations]

    @property
    def node_ids(self) -> list[str]:
        return [node for node, _ in self.locations]

    # ---- calls -------------------------------------------------------------------------
    def collective_rpc(self, method, args=(), unique_reply_rank=None, timeout_s=None):
        self.check_health()
        args_bytes = msgspec.msgpack.encode(list(args))
        refs = [a.call.remote(method, args_bytes) for a in self.actors]
        replies = [
            msgspec.msgpack.decode(r, type=_Reply) for r in self._wait(refs, method, timeout_s)
        ]
        for rank, reply in enumerate(replies):
            if reply.error is not None:
                raise WorkerCallError(rank, method, reply.error)
        values = [r.value for r in replies]
        return values if unique_reply_rank is None else [values[unique_reply_rank]]

    def submit(self, step: StepDescription) -> int:
        self.check_health()
        data = encode(step)
        self._handles += 1
        self._in_flight[self._handles] = [a.execute.remote(data) for a in self.actors]
        return self._handles

    def collect(self, handle: int) -> StepResult:
        refs = self._in_flight.pop(handle)
        values = self._wait(refs, "execute")
        rank = self.config.output_rank
        if values[rank] is None:
            raise ExecutorError(f"rank {rank} returned no step result")
        return check_step_result(decode_result(values[rank]), rank)

    def _wait(self, refs: list[Any], method: str, timeout_s: float | None = None) -> list[Any]:
        """Every ref's value, in order; raises the first failure: a rank that raised
        (WorkerCallError), an actor that died (WorkerDiedError), or `timeout_s`."""
        ray = self._ray
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    self._check_sentinels(wait_s=5.0)  # names the rank that died
                    raise ExecutorError(f"a Ray worker died during {method}") from None
                except ray.exceptions.RayTaskError as e:
                    # a peer's death breaks the others' collectives: report the cause
                    self._check_sentinels(wait_s=1.0)
                    raise WorkerCallError(refs.index(ref), method, str(e)) from None
            if pending:
                self._check_sentinels()
                if deadline is not None and time.monotonic() > deadline:
                    missing = sorted(refs.index(r) for r in pending)
                    raise ExecutorError(f"workers {missing} did not answer {method} in {timeout_s} s")
        return ray.get(list(refs))

    # ---- health ------------------------------------------------------------------------
    def check_health(self) -> None:
        if self._failure is None and not self._stopped:
            self._check_sentinels()
        if self._failure is not None:
            raise self._failure

    def _check_sentinels(self, wait_s: float = 0.0) -> None:
        """Record (and raise) the first actor whose sentinel resolved: it died."""
        if self._failure is None:
            done, _ = self._ray.wait(self._sentinels, num_returns=1, timeout=wait_s)
            if not done:
                return
            rank = self._sentinels.index(done[0])
            self._failure = WorkerDiedError(rank, self.locations[rank][1], None)
            logger.error("%s (Ray actor on node %s)", self._failure, self.locations[rank][0])
        raise self._failure

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        ray = self._ray
        if self._failure is None:
            try:
                ray.get([a.stop.remote() for a in self.actors], timeout=10)
            except (ray.exceptions.RayError, TimeoutError) as e:
                logger.warning("Ray workers did not stop cleanly: %s", e)
        for actor in self.actors:
            ray.kill(actor)
        ray.util.remove_placement_group(self._group)
