"""The engine: platform, model, KV arena, scheduler, runner and output processing, wired.

One step is: schedule, run, process outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from tokenmill.distributed.errors import ExecutorError
from tokenmill.distributed.executor import Executor, make_executor
from tokenmill.distributed.rendezvous import free_loopback_init_method
from tokenmill.engine.config import EngineArgs, EngineConfig
from tokenmill.engine.in_flight import InFlightSteps
from tokenmill.engine.kv_calibration import calibration_token_ids
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.engine.wiring import (
    check_parallel,
    connect_offload,
    drain_offload,
    dtype_name,
    engine_quantization,
    resolve_dtype,
    resolve_kv_cache_dtype,
    roofline_fields,
    roofline_meter,
    settle_offload,
    structured_masks,
)
from tokenmill.frontend.output_processor import (
    ADD_ERROR_VALUE,
    CoreOutputProcessor,
    OutputProcessor,
    add_error_kind,
    check_prompt,
)
from tokenmill.frontend.outputs import (
    EngineCoreOutput,
    EngineCoreRequest,
    RequestOutput,
    SchedulerStats,
)
from tokenmill.kv.eviction import RecomputeCost
from tokenmill.kv.groups import plan_groups
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv_connector.engine_setup import offload_config
from tokenmill.kv_connector.handover.engine_side import (
    EngineHandover,
    check_admission,
    check_sequences,
    handover_transport,
    new_engine_id,
    to_scheduler,
)
from tokenmill.kv_connector.handover.messages import HandoverIn
from tokenmill.model.generation_config import describe, load_generation_defaults
from tokenmill.model.loader import ModelInfo, default_model_path, load_model_info
from tokenmill.model.registry import attention_specs_for
from tokenmill.platforms.registry import (
    PlatformRegistry,
    load_platform,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.draft_models import draft_attention_specs
from tokenmill.spec_decode.engine_setup import draft_config, speculation, worker_spec_fields
from tokenmill.structured.manager import StructuredOutputManager
from tokenmill.structured.waitlist import GrammarWaitlist
from tokenmill.worker.sleep_mode import check_level

logger = logging.getLogger(__name__)

# With only grammar compiles in flight, how long a step waits for one to finish.
_GRAMMAR_WAIT_S = 0.005

class EngineSleepingError(RuntimeError):
    """A request reached an engine in sleep mode (`LLMEngine.sleep`); `wake_up` it first."""


class EngineDeadError(RuntimeError):
    """The engine's workers failed; it takes no more requests. Says why."""


class LLMEngine:
    def __init__(self, args: EngineArgs, registry: PlatformRegistry | None = None) -> None:
        """`registry`: where to find `args.platform`; None discovers installed plugins
        (entry points). Pass one to run in-process plugins (tests, the conformance suite)."""
        if args.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={args.data_parallel_size}: an LLMEngine is one replica; "
                "LLM and AsyncLLM build the replicas (tokenmill.frontend.data_parallel)"
            )
        self.args = args
        self.platform = load_platform(args.platform, registry)
        self.device = self.platform.platform.device
        self.dtype = resolve_dtype(args.dtype, self.platform)
        # what the KV cache stores (None: self.dtype); recurrent state keeps its own
        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.platform)
        torch.manual_seed(args.seed)

        model_path = args.model or default_model_path()
        # what requests that leave temperature, top_p... unset sample with
        self.generation_defaults, source = load_generation_defaults(model_path, args.generation_config)
        self.loaded: ModelInfo = load_model_info(model_path, tokenizer=args.tokenizer)
        self.tokenizer = self.loaded.tokenizer
        self.quantization = engine_quantization(args, self.loaded, self.platform)
        logger.info("loading %s (%s) on platform %s in %s, quantization %s",
                    self.loaded.model_path, self.loaded.hf_config.model_type,
                    self.platform.name, str(self.dtype).removeprefix("torch."),
                    self.quantization)
        self.max_model_len = min(args.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len)
        self.draft_config = draft_config(args, self.loaded.hf_config)

        self.kv_transport = handover_transport(args)  # P/D disaggregation (None: off)
        self.engine_id = new_engine_id(args.kv_role)
        self.executor = self._start_workers(registry is not None)
        try:
            self.num_kv_blocks = self.executor.initialize()
        except BaseException:
            self.executor.shutdown()
            raise
        # KV groups: one block table per group of layers of one attention type; every runner
        # reads them (the worker hands it the plan, `KVCacheSpec.layer_groups`)
        specs = attention_specs_for(self.loaded.hf_config, self.dtype, args.block_size,
                                    self.kv_cache_dtype)
        # a draft model's layers (mtp, eagle3) have KV of their own under the same tables
        spec_method = args.speculative_config.method if args.speculative_config else None
        specs += draft_attention_specs(spec_method, self.loaded.hf_config, self.draft_config,
                                       self.dtype, args.block_size)
        groups = plan_groups(specs).groups
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
        self.offload = connect_offload(args, self.executor, self.kv.groups)
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
        self.grammar_waitlist = GrammarWaitlist()  # sequences whose grammar is compiling
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
        self.handover = None if self.kv_transport is None else EngineHandover(
            self, self.kv_transport, self.engine_id)
        self.outputs = OutputProcessor(self.tokenizer)
        # pipeline parallel: steps submitted to the executor, not yet collected
        self.in_flight = InFlightSteps(self.executor.max_concurrent_batches)
        self._ids = itertools.count()
        # model FLOP/s and bytes/s of each step against the platform's HardwareSpec
        self.roofline = roofline_meter(self)
        self._pipeline_mark = 0.0  # when the pipeline's last collect (or first submit) was
        self.spec = speculation(self)  # after the roofline: its cost prior
        logger.info(
            "engine ready: platform=%s dtype=%s executor=%s kv_blocks=%d (%d tokens) "
            "max_model_len=%d", self.platform.name, self.dtype,
            self.config.parallel.distributed_executor_backend,
            self.num_kv_blocks, capacity, self.max_model_len,
        )
        logger.info(
            "default sampling parameters for requests that leave them unset (%s): %s; "
            "generation_config='vllm' turns them off", source, describe(self.generation_defaults),
        )

    def _observe(self, plan: SchedulerOutput, seconds: float) -> None:
        if self.roofline is not None:
            rows = [(s.start_position, len(s.token_ids)) for s in plan.scheduled]
            self.roofline.observe(rows, sum(s.sample for s in plan.scheduled), seconds)

    def _start_workers(self, in_process_registry: bool) -> Executor:
        """EngineArgs resolved into the one `EngineConfig` (kept as `self.config`), checked
        against the model and the platform, and the executor its parallel config names,
        its workers not yet set up."""
        args = self.args
        parallel = args.parallel_config()
        config = EngineConfig(
            model_path=self.loaded.model_path,
            platform=self.platform.name,
            dtype=str(self.dtype).removeprefix("torch."),
            quantization=self.quantization,
            kv_cache_dtype=dtype_name(self.kv_cache_dtype),
            kv_calibration_token_ids=calibration_token_ids(
                args.calculate_kv_scales, self.kv_cache_dtype is not None, self.tokenizer,
                min(args.max_num_batched_tokens, self.max_model_len)),
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len,
            seed=args.seed,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            memory_utilization=args.memory_utilization,
            parallel=parallel,
            dist_init_method=free_loopback_init_method() if parallel.world_size > 1 else None,
            kv_offload=offload_config(args),
            kv_transport=self.kv_transport,
            engine_id=self.engine_id,
            **worker_spec_fields(args),
        )
        self.config = config
        check_parallel(parallel, self.platform, self.loaded.hf_config, self.dtype,
                       args.block_size)
        return make_executor(
            parallel.distributed_executor_backend, config, self.platform, self.loaded.hf_config,
            in_process_registry,
        )

    def drain_kv_offload(self) -> None:
        """Wait for every KV load and save in flight and apply their report (tests and
        benchmarks read settled counters after it). No-op without offload."""
        if self.offload is not None:
            self.scheduler.update_from_connector(drain_offload(self.offload, self.executor))

    def shutdown(self) -> None:
        """Stop the workers (their processes, for "mp"); idempotent."""
        self.executor.shutdown()

    # ---- sleep mode (tokenmill.worker.sleep_mode) ----------------------------------------------
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
            settle_offload(self)
        if self.has_unfinished_requests():
            raise RuntimeError(
                f"cannot sleep with {len(self.scheduler.requests)} requests in flight; let "
                "them finish or abort them first")
        freed = sum(self.executor.collective_rpc("sleep", args=(level,)))
        self.kv.reset_prefix_cache()
        self._sleep_level = level
        logger.info("engine asleep (level %d): %.2f GiB freed on its workers", level,
                    freed / (1 << 30))

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
        handover_out: bool = False,
        handover_in: HandoverIn | None = None,
    ) -> None:
        """Queue a request (all its n sequences). P/D disaggregation: `handover_out`
        computes the prompt and one token and keeps the KV under a lease (the output's
        `kv_offer`); `handover_in` continues such a request from the pulled KV.
        Raises ValueError naming the problem if it can never run, and its subclass StructuredOutputError if its structured output
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
        check_sequences(params.n, handover_out, handover_in)
        core_requests = self.outputs.add(request_id, prompt, prompt_token_ids, params)
        for core_request in core_requests:
            core_request.cache_salt = cache_salt
            core_request.session_id = session_id
            core_request.handover_out = handover_out
            core_request.handover_in = handover_in
            self.add_core_request(core_request)

    def add_core_request(self, request: EngineCoreRequest) -> None:
        """Queue one sequence (the engine core's side of `add_request`; `params.n` is not
        looked at), already validated by the front that took it. Raises ValueError for a
        request id in use, StructuredOutputError / EngineDeadError as `add_request` does."""
        self.check_health()
        self._check_awake()
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        # the prompt was checked once, at the front that took the request (`add_request`
        # offline, `AsyncLLM.generate` served: `check_prompt`); generation defaults never
        # set max_tokens, so filling them (in `_admit`) changes nothing it checked
        if request.lease_prefix:
            if self.handover is None:
                raise ValueError("this engine leases no KV: start it with --kv-role "
                                 "prefill|decode or --kv-transport")
            self.handover.lease(request)
            return
        params = request.params
        if request.request_id in self.grammar_waitlist:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured.cached(params.structured_outputs)
            if grammar is None:  # compiled off the step loop; a later step admits it
                compiling = self.structured.compile_in_background(params.structured_outputs)
                self.grammar_waitlist.park(request.request_id, request, compiling)
                return
        self._admit(request, params, grammar)

    def _admit(self, request: EngineCoreRequest, params: SamplingParams, grammar) -> None:
        """Hand a checked sequence (with its compiled grammar, if any) to the scheduler."""
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
            handover_out=request.handover_out,
            handover_in=request.handover_in,
        )
        check_admission(self.handover, child)  # raises ValueError naming the mismatch
        if grammar is not None:
            self.structured.add_request(child.request_id, grammar)
        self.core_outputs.add(child)
        if to_scheduler(self.handover, child):
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
        self.grammar_waitlist.drop(request_ids)
        for rid in request_ids:
            self.core_outputs.finish(rid, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        handover = self.handover is not None and self.handover.busy()
        return handover or self.scheduler.has_unfinished_requests() or (
            len(self.grammar_waitlist) > 0)

    def release_handover(self, lease_ids: list[str]) -> int:
        """Decode engines are done with these leases (P/D disaggregation): their KV goes."""
        return self.handover.release(lease_ids) if self.handover is not None else 0

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Admit the waiting sequences whose grammar compiled; an error delta for each whose
        compile (or admission) failed."""
        failed = []
        for request, grammar, error in self.grammar_waitlist.ready():
            if error is None:
                try:
                    params = request.params.with_defaults(self.generation_defaults)
                    self._admit(request, params, grammar)
                    continue
                except ValueError as e:
                    error = e
            kind = add_error_kind(error) if isinstance(error, ValueError) else ADD_ERROR_VALUE
            failed.append(EngineCoreOutput(request.request_id, finish_reason="error",
                                           stop_reason=str(error), add_error=kind))
        return failed

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
            spec=self.spec.drafter.stats.snapshot(self.spec.drafter.method)
            if self.spec is not None else None,
            handover=self.handover.stats() if self.handover is not None else None,
            **roofline_fields(self.roofline),
        )

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step, both halves in-process: outputs for every request that changed."""
        processed = self.outputs.process(self.core_step())
        self.abort_core_requests(processed.abort_ids)
        return processed.outputs

    def core_step(self) -> list[EngineCoreOutput]:
        """One step of the engine core: schedule, execute, and the per-sequence deltas
        (first admitting the sequences whose grammar finished compiling)."""
        deltas = self._admit_compiled() if len(self.grammar_waitlist) else []
        if self.handover is not None:  # first tokens of handed-over requests
            deltas += self.handover.take_deltas()
        if not self.scheduler.has_unfinished_requests():  # only compiles are in flight
            if len(self.grammar_waitlist):
                self.grammar_waitlist.wait(_GRAMMAR_WAIT_S)
            return deltas
        if self.in_flight.depth > 1:
            return deltas + self._pipelined_step()
        return deltas + self._step()

    def _step(self) -> list[EngineCoreOutput]:
        began = time.perf_counter()  # speculative decoding weighs the whole step
        plan = self.scheduler.schedule()
        if plan.step is None:
            return []
        plan.step.structured = structured_masks(self.structured, plan)
        start = time.perf_counter()
        try:
            result = self.executor.execute(plan.step)
        except ExecutorError as e:
            return self._fail(e)
        self._observe(plan, time.perf_counter() - start)
        self.scheduler.update_computed(plan)
        self.scheduler.update_from_connector(result.kv_connector)
        deltas = self.core_outputs.process(result)
        if self.handover is not None:
            deltas = self.handover.after_step(result.kv_handover, deltas)
        if self.spec is not None:
            self.spec.drafter.receive(result.draft_token_ids, self.scheduler.requests)
            self.spec.verified(self.scheduler, plan.scheduled, result.accepted_token_ids)
            self.spec.observe(plan.scheduled, result.accepted_token_ids,
                              time.perf_counter() - began)
        return deltas

    def _pipelined_step(self) -> list[EngineCoreOutput]:
        """Pipeline parallel: fill the pipeline with up to `depth` micro-batches (each
        about 1 / depth of the unfinished requests), then collect the oldest. A request's
        tokens count as computed once its step is submitted, so the next micro-batch
        holds other requests, or the next chunk of a prompt in flight."""
        queue = self.in_flight
        if not queue:
            self._pipeline_mark = time.perf_counter()
        while not queue.full:
            share = -(-len(self.scheduler.requests) // queue.depth)
            plan = self.scheduler.schedule(max_num_scheduled=max(1, share))
            if plan.is_empty:  # every request waits for a step in flight (or for KV)
                break
            plan.step.structured = structured_masks(self.structured, plan)
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
        now = time.perf_counter()  # a full pipeline delivers a micro-batch per interval
        self._observe(entry.plan, now - self._pipeline_mark)
        self._pipeline_mark = now
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
