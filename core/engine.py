"""The engine: platform, model, KV arena, scheduler, runner and output processing, wired.

One step is: schedule, run, process outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import socket

import msgspec
import torch

from tokenmill.config import EngineArgs
from tokenmill.distributed.config import WorkerConfig
from tokenmill.distributed.errors import ExecutorError
from tokenmill.distributed.executor import Executor, UniExecutor, make_executor
from tokenmill.distributed.in_flight import InFlightSteps
from tokenmill.kv.eviction import RecomputeCost
from tokenmill.kv.groups import plan_groups
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv_connector.engine_setup import (
    Offload,
    engine_offload,
    offload_config,
    remote_engine_offload,
)
from tokenmill.kv_connector.messages import TierIndex, WorkerReport
from tokenmill.model.context_parallel import check_decode_context_parallel
from tokenmill.model.generation_config import describe, load_generation_defaults
from tokenmill.model.loader import ModelInfo, default_model_path, load_model_info
from tokenmill.model.parallel import check_sequence_parallel, local_config
from tokenmill.model.pipeline import check_pipeline
from tokenmill.model.registry import attention_specs_for
from tokenmill.output_processor import CoreOutputProcessor, OutputProcessor, check_prompt
from tokenmill.outputs import EngineCoreOutput, EngineCoreRequest, RequestOutput, SchedulerStats
from tokenmill.platforms.interfaces import AttentionKind
from tokenmill.platforms.registry import ActivePlatform, PlatformRegistry, load_platform
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.sleep_mode import check_level
from tokenmill.step import StructuredMasks
from tokenmill.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(name: str, platform: ActivePlatform) -> torch.dtype:
    """'auto' takes the platform's proposal; an explicit dtype must be one it supports."""
    if name == "auto":
        return platform.platform.default_dtype
    dtype = _DTYPES[name]
    if dtype not in platform.platform.capabilities.dtypes:
        supported = sorted(str(d).removeprefix("torch.") for d in platform.platform.capabilities.dtypes)
        raise ValueError(f"dtype={name!r} is not supported by platform {platform.name!r}; use one of {supported}")
    return dtype


class EngineSleepingError(RuntimeError):
    """A request reached an engine in sleep mode (`LLMEngine.sleep`); `wake_up` it first."""


class EngineDeadError(RuntimeError):
    """The engine's workers failed; it takes no more requests. Says why."""


def _rendezvous() -> str:
    """A torch.distributed init method on a free loopback port, for this host's workers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


class LLMEngine:
    def __init__(self, args: EngineArgs, registry: PlatformRegistry | None = None) -> None:
        """`registry`: where to find `args.platform`; None discovers installed plugins
        (entry points). Pass one to run in-process plugins (tests, the conformance suite)."""
        if args.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={args.data_parallel_size}: an LLMEngine is one replica; "
                "LLM and AsyncLLM build the replicas (tokenmill.distributed.data_parallel)"
            )
        self.args = args
        self.platform = load_platform(args.platform, registry)
        self.device = self.platform.platform.device
        self.dtype = resolve_dtype(args.dtype, self.platform)
        torch.manual_seed(args.seed)

        model_path = args.model or default_model_path()
        # what requests that leave temperature, top_p... unset sample with
        self.generation_defaults, source = load_generation_defaults(model_path, args.generation_config)
        self.loaded: ModelInfo = load_model_info(model_path, tokenizer=args.tokenizer)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(args.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len)

        self.executor = self._start_workers(registry is not None)
        try:
            self.num_kv_blocks = self.executor.initialize()
        except BaseException:
            self.executor.shutdown()
            raise
        # KV groups: one block table per group of layers of one attention type, where the
        # runner keeps them (the core's); a plugin's own runner gets one table for all layers
        groups = None
        specs = attention_specs_for(self.loaded.hf_config, self.dtype, args.block_size)
        if all(self.executor.collective_rpc("uses_kv_groups")):
            groups = plan_groups(specs).groups
        elif any(s.kind == AttentionKind.LINEAR for s in specs):
            self.executor.shutdown()
            raise ValueError(
                "this model has recurrent (linear attention) layers, whose state only the "
                "core's model runner keeps in the KV arena; the platform's own runner "
                "gets one block table per request: run it on a platform without one"
            )
        self.kv = KVCacheManager(
            self.num_kv_blocks, args.block_size, args.enable_prefix_caching, groups,
            eviction=args.kv_eviction,
            recompute_cost=RecomputeCost.from_specs(specs),
        )
        threshold = args.long_prefill_token_threshold
        if threshold is None:
            threshold = self.platform.platform.long_prefill_token_threshold or 0
        # the longest context one request can hold (a window holds its blocks + a chunk's)
        max_chunk = min(threshold or args.max_num_batched_tokens, args.max_num_batched_tokens)
        capacity = self.kv.max_request_tokens(max_chunk)
        if capacity < self.max_model_len:
            if args.max_model_len is not None:
                self.executor.shutdown()
                raise ValueError(
                    f"max_model_len={args.max_model_len} does not fit the KV pool of {capacity} "
                    "tokens; lower max_model_len or give the KV cache more memory"
                )
            self.max_model_len = capacity
        self.offload = self._connect_offload()
        self.failure: ExecutorError | None = None  # set when the workers cannot go on
        self._sleep_level: int | None = None  # set while asleep (sleep mode)
        self.scheduler = Scheduler(
            SchedulerConfig(
                args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len, threshold
            ),
            self.kv,
        )
        if self.offload is not None:
            self.scheduler.connector = self.offload.scheduler_side
        self.structured = StructuredOutputManager(
            self.tokenizer,
            vocab_size=self.loaded.hf_config.vocab_size,
            eos_token_ids=self.loaded.eos_token_ids,
            cache_size=args.structured_output_cache_size,
            compile_timeout_s=args.structured_output_compile_timeout_s,
        )
        # the engine core's half of output processing, and the frontend's (used in-process
        # by `add_request` / `step`; an engine process runs only the core's)
        self.core_outputs = CoreOutputProcessor(self.scheduler, self.max_model_len, self.structured)
        self.outputs = OutputProcessor(self.tokenizer)
        # pipeline parallel: steps submitted to the executor, not yet collected
        self.in_flight = InFlightSteps(self.executor.max_concurrent_batches)
        self._ids = itertools.count()
        logger.info(
            "engine ready: platform=%s dtype=%s executor=%s kv_blocks=%d (%d tokens) "
            "max_model_len=%d", self.platform.name, self.dtype, args.distributed_executor_backend,
            self.num_kv_blocks, capacity, self.max_model_len,
        )
        logger.info(
            "default sampling parameters for requests that leave them unset (%s): %s; "
            "generation_config='vllm' turns them off", source, describe(self.generation_defaults),
        )

    def _start_workers(self, in_process_registry: bool) -> Executor:
        """The executor for args.distributed_executor_backend, its workers not yet set up."""
        args = self.args
        tp, dcp = args.tensor_parallel_size, args.decode_context_parallel_size
        pcp = args.prefill_context_parallel_size
        config = WorkerConfig(
            model_path=self.loaded.model_path,
            platform=self.platform.name,
            dtype=str(self.dtype).removeprefix("torch."),
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len,
            seed=args.seed,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            memory_utilization=args.memory_utilization,
            distributed_executor_backend=args.distributed_executor_backend,
            world_size=args.world_size,
            tensor_parallel_size=tp,
            pipeline_parallel_size=args.pipeline_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            enable_sequence_parallelism=args.enable_sequence_parallelism,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=pcp,
            dist_init_method=_rendezvous() if args.world_size > 1 else None,
            kv_offload=offload_config(args),
        )
        if args.world_size > 1:  # a bad size fails here, before any process starts
            if not self.platform.platform.capabilities.collectives:
                raise ValueError(
                    f"{args.world_size} ranks (tensor_parallel_size={tp} x pipeline_parallel_"
                    f"size={args.pipeline_parallel_size} x decode_context_parallel_size={dcp} "
                    f"x prefill_context_parallel_size={pcp}) need collectives; platform "
                    f"{self.platform.name!r} declares none (capabilities.collectives)"
                )
        if tp > 1:
            local_config(self.loaded.hf_config, tp, args.enable_expert_parallel)
            if args.enable_sequence_parallelism:
                check_sequence_parallel(self.loaded.hf_config)
        if dcp > 1:
            specs = attention_specs_for(self.loaded.hf_config, self.dtype, args.block_size)
            check_decode_context_parallel(specs, args.block_size, dcp)
        if args.pipeline_parallel_size > 1:
            check_pipeline(self.loaded.hf_config, args.pipeline_parallel_size)
        return make_executor(
            args.distributed_executor_backend, config, self.platform, self.loaded.hf_config,
            in_process_registry,
        )

    def _connect_offload(self) -> Offload | None:
        """KV offload's engine side, or None without tiers: over the worker's own tier
        stack with the in-process executor; over a mirror of rank 0's stack, seeded from
        its index and kept up to date by its step reports, with worker processes."""
        if offload_config(self.args) is None:
            return None
        if isinstance(self.executor, UniExecutor):
            return engine_offload(
                self.executor.worker.kv_offload, self.args.block_size, self.kv.groups
            )
        (data,) = self.executor.collective_rpc("kv_offload_index", unique_reply_rank=0)
        return remote_engine_offload(msgspec.msgpack.decode(data, type=TierIndex), self.kv.groups)

    def drain_kv_offload(self) -> None:
        """Wait for every KV load and save in flight and apply their report (tests and
        benchmarks read settled counters after it). No-op without offload."""
        if self.offload is None:
            return
        if self.offload.worker_side is not None:
            report = self.offload.worker_side.drain()
        else:
            (data,) = self.executor.collective_rpc("kv_offload_drain", unique_reply_rank=0)
            report = msgspec.msgpack.decode(data, type=WorkerReport)
        self.scheduler.update_from_connector(report)

    def shutdown(self) -> None:
        """Stop the workers (their processes, for "mp"); idempotent."""
        self.executor.shutdown()

    # ---- sleep mode (tokenmill.sleep_mode) ----------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the device memory of every worker: level 1 keeps the weights in host memory
        and discards the KV cache, level 2 discards both (wake reads the checkpoint again).
        Only an idle engine sleeps (RuntimeError naming the requests in flight otherwise);
        the prefix cache is dropped with the KV it indexed. Requests while asleep raise
        EngineSleepingError; sleeping twice is an error."""
        level = check_level(level)
        self.check_health()
        if self._sleep_level is not None:
            raise RuntimeError(f"the engine is already asleep (level {self._sleep_level})")
        if self.offload is not None and not self.scheduler.requests:
            # recurrent checkpoints held for their save (kv_connector/checkpoints.py): a
            # step carries them, the drain releases them, so the prefix cache can be reset
            while self.scheduler.connector.has_unsent_saves:
                self.core_step()
            self.drain_kv_offload()
        if self.has_unfinished_requests():
            raise RuntimeError(
                f"cannot sleep with {len(self.scheduler.requests)} requests in flight; let "
                "them finish or abort them first")
        freed = sum(self.executor.collective_rpc("sleep", args=(level,)))
        self.kv.reset_prefix_cache()
        self._sleep_level = level
        logger.info("engine asleep (level %d): %.1f MiB freed on its workers", level,
                    freed / (1 << 20))

    def wake_up(self) -> None:
        """Give the workers their weights and KV cache back; greedy outputs are those of
        before the sleep. Waking an awake engine is an error."""
        self.check_health()
        if self._sleep_level is None:
            raise RuntimeError("the engine is not asleep")
        self.executor.collective_rpc("wake_up")
        self._sleep_level = None
        logger.info("engine awake")

    def is_sleeping(self) -> bool:
        return self._sleep_level is not None

    @property
    def sleep_level(self) -> int:
        """The sleep level now; 0 when awake."""
        return self._sleep_level or 0

    def _check_awake(self) -> None:
        if self._sleep_level is not None:
            raise EngineSleepingError(
                f"the engine is asleep (sleep level {self._sleep_level}): call wake_up() "
                "before adding requests")

    # ---- requests --------------------------------------------------------------------
    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> None:
        """Queue a request (all its n sequences). Raises ValueError naming the problem if it
        can never run, and its subclass StructuredOutputError if its structured output
        constraint is invalid or takes too long to compile; nothing is queued then. Raises
        EngineDeadError once the workers have failed, EngineSleepingError in sleep mode."""
        self.check_health()
        self._check_awake()
        if request_id in self.outputs.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_prompt(prompt_token_ids, params, self.loaded.hf_config.vocab_size, self.max_model_len)
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)
        params = dataclasses.replace(
            params, eos_token_ids=frozenset(self.loaded.eos_token_ids) | params.eos_token_ids
        )
        core_requests = self.outputs.add(request_id, prompt, prompt_token_ids, params)
        for core_request in core_requests:
            core_request.cache_salt = cache_salt
            core_request.session_id = session_id
            self.add_core_request(core_request)

    def add_core_request(self, request: EngineCoreRequest) -> None:
        """Queue one sequence (the engine core's side of `add_request`; `params.n` is not
        looked at). Raises ValueError / StructuredOutputError / EngineDeadError as
        `add_request` does."""
        self.check_health()
        self._check_awake()
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        # the model's generation defaults for what the request left unset (a no-op when the
        # frontend's add_request filled them already)
        params = request.params.with_defaults(self.generation_defaults)
        check_prompt(
            request.prompt_token_ids, params, self.loaded.hf_config.vocab_size, self.max_model_len
        )
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured.compile(params.structured_outputs)
        # every sequence passes here (offline, served in-process or from another process)
        params = params.with_defaults(self.generation_defaults)
        if not params.eos_token_ids >= self.loaded.eos_token_ids:
            params = dataclasses.replace(
                params, eos_token_ids=frozenset(self.loaded.eos_token_ids) | params.eos_token_ids
            )
        child = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=params,
            cache_salt=request.cache_salt,
            session_id=request.session_id,
            seed=params.seed,
        )
        if grammar is not None:
            self.structured.add_request(child.request_id, grammar)
        self.core_outputs.add(child)
        self.scheduler.add_request(child)

    def hint_session(self, session_id: str) -> None:
        """The session's last turn ended in a tool call: it will be back. With KV offload,
        its next turn's blocks are prefetched into the fastest tier when it arrives."""
        if self.offload is not None:
            self.offload.scheduler_side.session_returns(session_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort every sequence of a request; its final output, None if it is unknown."""
        out, core_ids = self.outputs.abort(request_id)
        self.abort_core_requests(core_ids)
        return out

    def abort_core_requests(self, request_ids: list[str]) -> None:
        """Abort sequences by their engine core ids; unknown or finished ones are skipped."""
        for rid in request_ids:
            self.core_outputs.finish(rid, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preemptions=self.scheduler.num_preemptions,
            kv_usage=self.kv.usage,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            kv_tiers=self.offload.snapshot() if self.offload is not None else {},
            kv_blocks_by_type=self.kv.blocks_in_use_by_type(),
            kv_blocks_usable=self.kv.pool.num_usable_blocks,
        )

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step, both halves in-process: outputs for every request that changed."""
        processed = self.outputs.process(self.core_step())
        self.abort_core_requests(processed.abort_ids)
        return processed.outputs

    def core_step(self) -> list[EngineCoreOutput]:
        """One step of the engine core: schedule, execute, and the per-sequence deltas."""
        if self.in_flight.depth > 1:
            return self._pipelined_step()
        plan = self.scheduler.schedule()
        if plan.step is None:
            return []
        plan.step.structured = self._structured_masks(plan)
        try:
            result = self.executor.execute(plan.step)
        except ExecutorError as e:
            return self._fail(e)
        self.scheduler.update_computed(plan)
        self.scheduler.update_from_connector(result.kv_connector)
        return self.core_outputs.process(result)

    def _pipelined_step(self) -> list[EngineCoreOutput]:
        """Pipeline parallel: fill the pipeline with up to `depth` micro-batches (each
        about 1 / depth of the unfinished requests), then collect the oldest. A request's
        tokens count as computed once its step is submitted, so the next micro-batch
        holds other requests, or the next chunk of a prompt in flight."""
        queue = self.in_flight
        while not queue.full:
            share = -(-len(self.scheduler.requests) // queue.depth)
            plan = self.scheduler.schedule(max_num_scheduled=max(1, share))
            if plan.is_empty:  # every request waits for a step in flight (or for KV)
                break
            plan.step.structured = self._structured_masks(plan)
            self.scheduler.update_computed(plan)
            try:
                handle = self.executor.submit(plan.step)
            except ExecutorError as e:
                queue.clear()
                return self._fail(e)
            queue.push(plan, handle, self.scheduler.requests)
        if not queue:
            return []
        entry = queue.pop()
        try:
            result = self.executor.collect(entry.handle)
        except ExecutorError as e:
            queue.clear()
            return self._fail(e)
        return self.core_outputs.process(entry.current(result, self.scheduler.requests))

    # ---- health ----------------------------------------------------------------------
    def check_health(self) -> None:
        """Raises EngineDeadError naming the cause once the workers cannot go on."""
        if self.failure is None:
            try:
                self.executor.check_health()
            except ExecutorError as e:
                self._fail(e)
        if self.failure is not None:
            raise EngineDeadError(f"the engine cannot run: {self.failure}") from self.failure

    @property
    def is_healthy(self) -> bool:
        try:
            self.check_health()
        except EngineDeadError:
            return False
        return True

    def _fail(self, error: ExecutorError) -> list[EngineCoreOutput]:
        """The workers failed: every sequence in flight finishes with an error naming why."""
        logger.error("engine failed: %s; failing %d sequences", error, len(self.scheduler.requests))
        self.failure = error
        self.executor.shutdown()  # the ranks still alive cannot go on without the others
        return self.core_outputs.fail_all(f"engine failed: {error}")

    def _structured_masks(self, plan: SchedulerOutput) -> StructuredMasks | None:
        """This step's grammar masks for its constrained sampling rows, or None."""
        if not self.structured.num_requests:
            return None
        masks = self.structured.step_masks([s.request_id for s in plan.scheduled if s.sample])
        if masks is None:
            return None
        return StructuredMasks(
            bitmask=masks.bitmask.numpy().astype("<i4", copy=False).tobytes(),
            num_words=masks.bitmask.shape[1],
            row_indices=masks.row_indices,
            ended_rows=masks.ended_rows,
        )
