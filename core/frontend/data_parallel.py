"""Data parallel: `data_parallel_size` whole engine cores (each with its own workers,
tensor and pipeline parallel inside) behind one front, requests placed by
`PrefixAffinityRouter` (tokenmill.frontend.dp_router: prefix-cache affinity, else
least loaded).

Two fronts:
- `DataParallelClient` speaks the engine core client contract of
  tokenmill.frontend.engine_core_client over one client per replica: an engine process each
  (`tokenmill serve -dp N`: the replicas step in parallel) or an engine thread each
  (in-process `AsyncLLM`). Outputs of every replica reach the frontend as they come;
  the scheduler stats it reports are the replicas' summed. One replica that dies ends
  the whole front (its `on_dead`), as one engine's death would, and the others are asked
  to stop. With the "ray" executor each engine process joins a Ray cluster as any
  `ray.init()` does: RAY_ADDRESS, else this machine's current cluster.
- `DataParallelEngine` is `LLM`'s: the replicas are `LLMEngine`s in this process,
  stepped in turn (their workers, with "mp", run in processes of their own).

A replica's requests keep their ids; the router remembers which replica runs each until
it finishes, so aborts go to the right one.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from tokenmill.engine.config import EngineArgs
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.frontend.dp_router import PrefixAffinityRouter
from tokenmill.frontend.engine_core_client import (
    EngineCoreProcClient,
    InprocClient,
    OnDead,
    OnOutputs,
)
from tokenmill.frontend.outputs import (
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestOutput,
    SchedulerStats,
    SpecDecodeStats,
)
from tokenmill.sampling_params import SamplingParams


def replica_args(args: EngineArgs) -> EngineArgs:
    """One replica's arguments: the same, with data_parallel_size 1."""
    return args.model_copy(update={"data_parallel_size": 1})


def merge_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' stats as one engine's: counts, FLOP/s and bytes/s summed, KV usage
    and roofline utilisation averaged."""
    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return SchedulerStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        kv_usage=mean([s.kv_usage for s in stats]),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        spec=merge_spec_stats([s.spec for s in stats if s.spec is not None]),
        model_flops_per_s=sum(s.model_flops_per_s for s in stats),
        flops_utilization=mean([s.flops_utilization for s in stats]),
        model_bytes_per_s=sum(s.model_bytes_per_s for s in stats),
        bandwidth_utilization=mean([s.bandwidth_utilization for s in stats]),
        model_flops_total=sum(s.model_flops_total for s in stats),
        model_bytes_total=sum(s.model_bytes_total for s in stats),
    )


def merge_spec_stats(stats: list[SpecDecodeStats]) -> SpecDecodeStats | None:
    """Speculative decoding's counters of every replica, summed (None: off)."""
    if not stats:
        return None
    width = max(len(s.accepted_per_position) for s in stats)
    return SpecDecodeStats(
        stats[0].method,
        sum(s.num_drafts for s in stats),
        sum(s.num_draft_tokens for s in stats),
        sum(s.num_accepted_tokens for s in stats),
        [sum(s.accepted_per_position[i] for s in stats if i < len(s.accepted_per_position))
         for i in range(width)],
    )


class DataParallelClient:
    """An engine core client over `clients` (one per replica), placing requests with
    `router`."""

    def __init__(self, clients: list[Any], router: PrefixAffinityRouter,
                 engines: list[LLMEngine] | None = None) -> None:
        self.clients = clients
        self.router = router
        self.engines = engines or []  # the in-process replicas' engines (else empty)
        self._stats = [SchedulerStats() for _ in clients]
        self._lock = threading.Lock()  # one replica's outputs at a time reach the frontend
        self._dead = False

    @classmethod
    def in_processes(cls, args: EngineArgs) -> DataParallelClient:
        """An engine process per replica (started one after another)."""
        clients: list[EngineCoreProcClient] = []
        try:
            for _ in range(args.data_parallel_size):
                clients.append(EngineCoreProcClient(replica_args(args),
                                                    host_replicas=args.data_parallel_size))
        except BaseException:
            for client in clients:
                client.shutdown()
            raise
        return cls(clients, PrefixAffinityRouter(args.data_parallel_size, args.block_size))

    @classmethod
    def in_threads(cls, args: EngineArgs, registry=None) -> DataParallelClient:
        """An in-process engine per replica, each stepped on a thread of its own."""
        engines = _build_engines(args, registry)
        router = PrefixAffinityRouter(args.data_parallel_size, args.block_size)
        return cls([InprocClient(e) for e in engines], router, engines)

    @property
    def ready(self):
        """What the first replica reported when it loaded (every replica loads the same
        model with the same arguments)."""
        return self.clients[0].ready

    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        for i, client in enumerate(self.clients):
            client.start(self._outputs_of(i, on_outputs), self._dead_of(i, on_dead))

    def _outputs_of(self, replica: int, on_outputs: OnOutputs) -> OnOutputs:
        def handle(message: EngineCoreOutputs) -> None:
            for out in message.outputs:
                if out.finish_reason is not None:
                    self.router.finished(out.request_id)
            with self._lock:
                if self._dead:
                    return
                if message.stats is not None:
                    self._stats[replica] = message.stats
                    message.stats = merge_stats(self._stats)
                on_outputs(message)

        return handle

    def _dead_of(self, replica: int, on_dead: OnDead) -> OnDead:
        def handle(error: BaseException) -> None:
            with self._lock:
                if self._dead:
                    return
                self._dead = True
            # the front is gone: the other replicas stop too, asked first (each exits at
            # once, tokenmill.engine.engine_core) and whatever the frontend's callback does
            for i, client in enumerate(self.clients):
                if i != replica:
                    threading.Thread(target=client.shutdown, name=f"tokenmill-dp-stop-{i}",
                                     daemon=True).start()
            on_dead(error)

        return handle

    @property
    def is_dead(self) -> bool:
        return self._dead or any(c.is_dead for c in self.clients)

    def add(self, requests: list[EngineCoreRequest]) -> None:
        by_replica: dict[int, list[EngineCoreRequest]] = {}
        for request in requests:
            replica = self.router.route(request.request_id, request.prompt_token_ids,
                                        request.cache_salt)
            by_replica.setdefault(replica, []).append(request)
        for replica, batch in by_replica.items():
            try:
                self.clients[replica].add(batch)
            except BaseException:
                for request in requests:
                    self.router.finished(request.request_id)
                raise

    def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            replica = self.router.owner(rid)
            if replica is not None:
                by_replica.setdefault(replica, []).append(rid)
        for replica, ids in by_replica.items():
            self.clients[replica].abort(ids)

    def hint_session(self, session_id: str) -> None:
        for client in self.clients:  # a hint costs a lookup where the session is unknown
            client.hint_session(session_id)

    def release(self, lease_ids: list[str]) -> None:
        for client in self.clients:  # a replica skips the leases it does not hold
            client.release(lease_ids)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        for client in self.clients:
            client.shutdown(timeout_s)


class DataParallelEngine:
    """`LLM`'s engine for data_parallel_size > 1: the replicas' `LLMEngine`s, the
    `LLMEngine` methods `LLM` uses, requests placed by the router."""

    def __init__(self, args: EngineArgs, registry=None) -> None:
        self.args = args
        self.replicas = _build_engines(args, registry)
        self.router = PrefixAffinityRouter(args.data_parallel_size, args.block_size)
        first = self.replicas[0]
        self.tokenizer, self.loaded = first.tokenizer, first.loaded
        self.max_model_len = min(e.max_model_len for e in self.replicas)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, cache_salt: str | None = None,
                    session_id: str | None = None) -> int:
        """Queue the request on its replica (as LLMEngine.add_request); returns which."""
        replica = self.router.route(request_id, prompt_token_ids, cache_salt)
        try:
            self.replicas[replica].add_request(request_id, prompt_token_ids, params, prompt,
                                               cache_salt, session_id)
        except BaseException:
            self.router.finished(request_id)
            raise
        return replica

    def abort_request(self, request_id: str) -> RequestOutput | None:
        replica = self.router.owner(request_id)
        if replica is None:
            return None
        self.router.finished(request_id)
        return self.replicas[replica].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for engine in self.replicas:
            if engine.has_unfinished_requests():
                outputs += engine.step()
        for out in outputs:
            if out.finished:
                self.router.finished(out.request_id)
        return outputs

    @property
    def is_healthy(self) -> bool:
        return all(e.is_healthy for e in self.replicas)

    def shutdown(self) -> None:
        for engine in self.replicas:
            engine.shutdown()


def _build_engines(args: EngineArgs, registry) -> list[LLMEngine]:
    engines: list[LLMEngine] = []
    try:
        for _ in range(args.data_parallel_size):
            engines.append(LLMEngine(replica_args(args), registry))
    except BaseException:
        for engine in engines:
            engine.shutdown()
        raise
    return engines
