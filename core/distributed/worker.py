"""A worker: one rank's device, model runner and KV arena.

Built from a plain `EngineConfig` inside its own process (the "mp" executor) or in the
engine's (the "uni" executor). Executors drive it by method name (`collective_rpc`), in
this order: `init_device`, `load_model`, `determine_num_blocks`, `initialize_kv_cache`,
then `execute` once per step, `shutdown` last.

Every runner is treated alike (the core's and a platform's own both come through
`tokenmill_model_runner`): the worker checks its `RunnerCapabilities` once, owns the KV
arena its `KVCacheLayout` asks for and hands it page views, so sizing, KV offload and
sleep mode never ask which runner it is.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import msgspec
import torch

from tokenmill.distributed.parallel_state import (
    ParallelLayout,
    ParallelState,
    destroy_parallel_state,
    init_parallel_state,
)
from tokenmill.engine.config import EngineConfig
from tokenmill.kv.arena import KVArena
from tokenmill.kv.groups import plan_groups
from tokenmill.kv.sizing import kv_cache_budget
from tokenmill.kv_connector.engine_setup import WorkerOffload, make_worker_offload
from tokenmill.kv_connector.handover.reshard import page_shards
from tokenmill.kv_connector.handover.worker_side import HandoverWorker, make_handover_worker
from tokenmill.model.loader import checkpoint_weights, load_model_info
from tokenmill.model.pipeline import stage_weight_filter
from tokenmill.model.registry import attention_specs_for, family_for
from tokenmill.platforms.interfaces import (
    AllocatorPurpose,
    KVCacheLayout,
    KVCachePages,
    KVCacheSpec,
    MemoryInfo,
    ModelRunnerBase,
    ModelRunnerContext,
    RecurrentStateSpec,
    RunnerCapabilities,
)
from tokenmill.platforms.kv_handover import PageShard
from tokenmill.platforms.registry import ActivePlatform, PlatformRegistry, load_platform
from tokenmill.platforms.step import StepDescription, StepResult
from tokenmill.worker.sleep_mode import check_level

_GIB = 1 << 30  # every size this module logs is in GiB

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        platform: ActivePlatform | None = None,
        hf_config: Any = None,
    ) -> None:
        """`platform` / `hf_config`: the engine's own, when the worker runs in its process
        (they are loaded again from the config otherwise)."""
        self.config = config
        self.rank = rank
        self.platform = platform
        self.hf_config = hf_config
        self.runner: ModelRunnerBase | None = None
        # the plugin whose tokenmill_model_runner built the runner: the active platform's
        # name, or "tokenmill" (the core's model_runner plugin)
        self.runner_provider: str | None = None
        self.runner_caps: RunnerCapabilities | None = None
        self.kv_layout: KVCacheLayout | None = None
        self.arena: KVArena | None = None  # the KV arena the runner's pages view
        self.context: ModelRunnerContext | None = None
        self._memory_at_start: MemoryInfo | None = None
        # this rank's process groups (one rank until init_device joins the world)
        self.parallel_state = ParallelState.single()
        self._owns_parallel_state = False
        self.kv_offload: WorkerOffload | None = None  # KV offload's worker half, if configured
        self.handover: HandoverWorker | None = None  # P/D disaggregation's transport, if set
        self._sleep_level: int | None = None  # set while asleep
        # a digest of the KV scales when calibrated at load (calculate_kv_scales), else "":
        # part of the offload fingerprint and the P/D handshake
        self.kv_scales = ""

    # ---- set-up, in the executor's order -----------------------------------------------
    def init_device(self) -> None:
        if self.platform is None:
            self.platform = load_platform(self.config.platform, PlatformRegistry.discover())
        if self.hf_config is None:
            self.hf_config = load_model_info(self.config.model_path, load_tokenizer=False).hf_config
        torch.manual_seed(self.config.seed)
        if self.config.parallel.world_size > 1:
            self._init_parallel_state()
        # before any weights: the KV cache is sized from what the engine adds to this
        self._memory_at_start = self.platform.platform.memory_info()

    def load_model(self) -> None:
        """Build the model runner through `tokenmill_model_runner` (the platform plugin's own
        first, the core's otherwise; it loads the weights) and check its capabilities
        against the model and the engine's settings, once."""
        self.context = self._runner_context()
        self.runner, self.runner_provider = self._platform.model_runner(self.context)
        self.runner_caps = self.runner.capabilities()
        self.kv_layout = self.runner.kv_cache_layout()
        self._check_runner()
        logger.info("rank %d: model runner %s (from plugin %r), %s", self.rank,
                    type(self.runner).__name__, self.runner_provider, self.runner_caps)
        if self.config.kv_calibration_token_ids:
            self._calibrate_kv_scales()

    def _calibrate_kv_scales(self) -> None:
        """The runner's KV scale calibration (calculate_kv_scales) over the engine's sample,
        on scratch arenas of the layers' plain specs (the compute dtype), freed right after;
        before the KV arena exists, so no KV is stored with other scales."""
        runner = self._runner
        calibrate = getattr(runner, "calibrate_kv_scales", None)
        if calibrate is None:
            raise ValueError(
                f"calculate_kv_scales: {type(runner).__name__} (from plugin "
                f"{self.runner_provider!r}) does not calibrate KV scales; drop "
                "calculate_kv_scales or use a checkpoint that carries k_scale / v_scale")
        layout = self._layout
        plain = [dataclasses.replace(s, cache_dtype=None) if s.cache_dtype is not None else s
                 for s in layout.attention_specs]
        allocator = self._platform.allocator(AllocatorPurpose.KV_ARENA)
        scratch: list[KVArena] = []

        def pages(num_blocks: int) -> KVCachePages:
            scratch.append(KVArena.create(
                allocator, plain, num_blocks=num_blocks, device=self.context.device,
                layer_slots=self._layer_slots(), backends=layout.backends))
            return self._pages(scratch[-1], num_blocks)

        try:
            self.kv_scales = calibrate(pages, list(self.config.kv_calibration_token_ids))
        finally:
            for arena in scratch:
                allocator.free(arena.buffer)

    def _check_runner(self) -> None:
        runner, caps, layout = self._runner, self.runner_caps, self.kv_layout
        who = f"{type(runner).__name__} (from plugin {self.runner_provider!r})"
        kinds = {s.kind for s in self.context.kv_cache.attention_specs}
        missing = kinds - caps.attention_kinds
        if missing:
            raise ValueError(
                f"model type {self.hf_config.model_type!r} has "
                f"{sorted(k.value for k in missing)} layers, which {who} does not run (it "
                f"runs {sorted(k.value for k in caps.attention_kinds)}); choose another "
                "platform or model"
            )
        if self.config.kv_offload is not None and not caps.kv_offload:
            raise ValueError(f"KV offload is configured but {who} declares no kv_offload "
                             "(its KV does not stay in the worker's pages); turn offload off")
        if self.config.kv_transport is not None and not caps.kv_offload:
            raise ValueError(f"prefill/decode disaggregation moves KV through the worker's "
                             f"pages but {who} declares no kv_offload (its KV does not stay "
                             "in them); serve this model with kv_role 'both'")
        if layout.layer_slots is None and len(layout.attention_specs) != len(
                self.context.kv_cache.layer_slots):
            raise ValueError(f"{who} lays out {len(layout.attention_specs)} layers without "
                             f"slots; the model has {len(self.context.kv_cache.layer_slots)}")

    def determine_num_blocks(self) -> int:
        """How many KV blocks this rank holds: `num_kv_blocks` if set; else as many as fit
        `kv_cache_memory_bytes` if set; else what `memory_utilization` leaves after the
        weights and a profiling step (tokenmill.kv.sizing). Capped by the KV allocator, and
        by what all `max_num_seqs` sequences at `max_model_len` could use at once."""
        runner, config = self._runner, self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory_bytes is not None:
            budget, why = config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        else:
            self._profile(runner)
            sized = kv_cache_budget(
                self._memory_at_start, self._platform.platform.memory_info(),
                config.memory_utilization,
            )
            budget, why = sized.num_bytes, sized.explanation
        allocator = self._platform.allocator(AllocatorPurpose.KV_ARENA)
        room = allocator.bytes_limit() - allocator.bytes_in_use()
        if budget > room:
            budget, why = room, f"{why}; capped by the KV allocator's {room / _GIB:.2f} GiB free"
        block_bytes = self.kv_block_bytes()
        num_blocks = budget // block_bytes - self._layout.reserved_blocks
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache gets {budget} bytes ({why}), which holds no block of "
                f"{block_bytes} bytes; raise memory_utilization, set kv_cache_memory_bytes "
                "or num_kv_blocks, or free device memory"
            )
        most = config.max_num_seqs * -(-config.max_model_len // config.block_size)
        num_blocks = min(num_blocks, most)
        logger.info("rank %d: %d KV blocks of %d tokens, %.2f GiB (%s)", self.rank, num_blocks,
                    config.block_size, num_blocks * block_bytes / _GIB, why)
        return num_blocks

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block on this rank, over the layers its runner caches (its own KV
        heads only, with tensor parallel; its stage's layers, with pipeline parallel)."""
        layout = self._layout
        return KVArena.block_bytes_for(list(layout.attention_specs), self._layer_slots(),
                                       layout.backends)

    def _layer_slots(self) -> tuple[int, ...]:
        layout = self._layout
        return layout.layer_slots if layout.layer_slots is not None else (
            self.context.kv_cache.layer_slots)

    def _make_arena(self, num_blocks: int) -> KVArena:
        layout = self._layout
        return KVArena.create(
            self._platform.allocator(AllocatorPurpose.KV_ARENA), list(layout.attention_specs),
            num_blocks=num_blocks, device=self.context.device, layer_slots=self._layer_slots(),
            backends=layout.backends,
        )

    @staticmethod
    def _pages(arena: KVArena, num_blocks: int) -> KVCachePages:
        return KVCachePages(num_blocks, tuple(arena.layer_caches), arena.page_bytes)

    def _profile(self, runner: ModelRunnerBase) -> None:
        """The runner's profiling step on scratch arenas, freed right after."""
        scratch: list[KVArena] = []

        def pages(num_blocks: int) -> KVCachePages:
            scratch.append(self._make_arena(num_blocks))
            return self._pages(scratch[-1], num_blocks)

        allocator = self._platform.allocator(AllocatorPurpose.KV_ARENA)
        try:
            runner.profile(pages)
        finally:
            for arena in scratch:
                allocator.free(arena.buffer)

    def parameter_bytes(self) -> int:
        """Bytes of the model parameters this rank holds (its shard, with tensor parallel);
        0 for a platform's own runner, whose weights the core does not see."""
        model = getattr(self._runner, "model", None)
        if model is None:
            return 0
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def communicated_bytes(self, dim: str) -> int:
        """Payload bytes this rank has passed through dimension `dim`'s communicator."""
        return self.parallel_state.communicated_bytes().get(dim, 0)

    def communicated_op_bytes(self, dim: str, op: str) -> int:
        """Payload bytes this rank has passed through collective `op` (a Communicator
        method name) of dimension `dim`'s communicator; 0 when it has none."""
        group = self.parallel_state.groups.get(dim)
        return 0 if group is None or group.communicator is None else group.communicator.bytes.get(op, 0)

    def verifies_drafts(self) -> bool:
        """Whether this rank's runner verifies speculative drafts (`StepDescription.
        spec_token_ids`): what its capabilities declare (the core's does, through the
        platform's attention)."""
        return self.runner_caps.speculative

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The arena of `num_blocks` blocks (plus the runner's reserved ones), handed to the
        runner as page views; the KV offload's worker half over the same pages."""
        self.arena = self._make_arena(num_blocks + self._layout.reserved_blocks)
        self._runner.bind_kv_cache(self._pages(self.arena, num_blocks))
        if self.config.kv_offload is not None:
            self.kv_offload = make_worker_offload(
                self.config.kv_offload, self.config.model_path, self.hf_config,
                self.arena.page_rows(), self._platform, self.config.block_size,
                self.config.kv_cache_dtype or self.config.dtype,  # what the pages hold
                kv_scales=self.kv_scales,
            )
            if self.config.parallel.distributed_executor_backend != "uni":
                # the engine's scheduler side mirrors the stack from our reports
                self.kv_offload.stack.record_changes()
                self.kv_offload.worker_side.mirrored = True

        if self.config.kv_transport is not None:  # the runner declared kv_offload (checked)
            self.handover = make_handover_worker(
                self.config.kv_transport, self.config.engine_id, self.rank, self.arena,
                str(self._platform.platform.device), self.parallel_state, self._page_shards(),
                self._whole_states())

    def _page_shards(self) -> list[PageShard]:
        """How this rank holds each KV group's pages (the model's specs against its own)."""
        kv, layout = self.context.kv_cache, self._layout
        tp = self.parallel_state.group("tp")
        return page_shards(kv.layer_groups, kv.attention_specs, layout.attention_specs,
                           layout.backends, tp.world_size, tp.rank_in_group,
                           self.arena.page_bytes)

    def _whole_states(self) -> list[RecurrentStateSpec | None]:
        """Per KV group, the model's whole recurrent state spec (None: attention)."""
        kv = self.context.kv_cache
        out: list[RecurrentStateSpec | None] = [None] * (max(kv.layer_groups) + 1)
        for spec, g in zip(kv.attention_specs, kv.layer_groups, strict=True):
            out[g] = spec.state
        return out

    def kv_scales_digest(self) -> str:
        """A digest of this rank's calibrated KV scales ("" when not calibrated)."""
        return self.kv_scales

    def handover_endpoint(self) -> bytes:
        """This rank's transport descriptor and arena geometry (msgpack `RankEndpoint`)."""
        if self.handover is None:
            raise RuntimeError("this worker has no KV transport (kv_transport is not set)")
        return msgspec.msgpack.encode(self.handover.endpoint())

    def kv_offload_index(self) -> bytes:
        """Everything this rank's KV tiers hold, as a msgpack `TierIndex` (the seed of
        the engine's mirror, kv_connector/directory.py). Changes logged before it are
        dropped: the index already has them."""
        offload = self._offload
        offload.stack.take_changes()
        index = offload.stack.index(offload.layout.fingerprint(), self.config.block_size)
        return msgspec.msgpack.encode(index)

    def kv_offload_drain(self) -> bytes:
        """Wait for every KV load and save in flight; their msgpack `WorkerReport`."""
        return msgspec.msgpack.encode(self._offload.worker_side.drain())

    # ---- sleep mode (tokenmill.worker.sleep_mode) ----------------------------------------------
    def sleep(self, level: int) -> int:
        """Free this rank's KV arena (contents discarded) and the runner's weights (kept in
        host memory at level 1, discarded at 2); returns the bytes freed. The engine calls
        it only while no request is in flight."""
        level = check_level(level)
        self._check_sleep_mode()
        if self._sleep_level is not None:
            raise RuntimeError(f"rank {self.rank} is already asleep (level {self._sleep_level})")
        freed = self._platform.allocator(AllocatorPurpose.KV_ARENA).sleep(keep_contents=False)
        freed += self._runner.sleep(level)
        self._sleep_level = level
        logger.info("rank %d asleep (level %d): %.2f GiB freed", self.rank, level, freed / _GIB)
        return freed

    def wake_up(self) -> None:
        """Give the KV arena its memory back (zeroed), then the runner its weights."""
        self._check_sleep_mode()
        if self._sleep_level is None:
            raise RuntimeError(f"rank {self.rank} is not asleep")
        self._platform.allocator(AllocatorPurpose.KV_ARENA).wake()
        self._runner.wake_up(self._sleep_level)
        self._sleep_level = None
        logger.info("rank %d awake", self.rank)

    def _check_sleep_mode(self) -> None:
        platform = self._platform
        if not platform.platform.capabilities.sleep_mode:
            raise RuntimeError(f"platform {platform.name!r} declares no sleep mode "
                               "(capabilities.sleep_mode)")
        if not self.runner_caps.sleep_mode:
            raise RuntimeError(f"sleep mode: {type(self._runner).__name__} (from plugin "
                               f"{self.runner_provider!r}) declares no sleep mode")

    # ---- steps -------------------------------------------------------------------------
    def execute(self, step: StepDescription) -> StepResult | None:
        """Run one step; the output rank (`EngineConfig.output_rank`: rank 0, or TP rank 0
        of the last pipeline stage) returns its result, the other ranks None."""
        connector = self.kv_offload.worker_side if self.kv_offload is not None else None
        meta = step.kv_connector
        if connector is not None and meta is not None:
            connector.begin_step(meta)  # loads overlap this step's forward pass
        if self.handover is not None and step.kv_handover is not None:
            self.handover.apply(step.kv_handover)  # pulls run during the forward pass
        start = time.perf_counter()
        result = self._runner.execute(step)
        seconds = time.perf_counter() - start
        if connector is not None:
            if meta is not None:
                connector.end_step(meta)  # the blocks this step filled, copied out now
            # a step with nothing to compute waits a little for a load to report
            result.kv_connector = report = connector.report(
                wait_s=0.0 if step.scheduled_request_ids else 0.005
            )
            report.step_tokens = step.total_num_scheduled_tokens
            report.step_seconds = seconds
        if self.handover is not None:
            # every rank reports (the TP group agrees on which pulls ended); a step with
            # nothing to compute waits a little for a pull to end
            result.kv_handover = self.handover.report(
                wait_s=0.0 if step.scheduled_request_ids else 0.005)
        return result if self.rank == self.config.output_rank else None

    def shutdown(self) -> None:
        if self.handover is not None:
            self.handover.close()
            self.handover = None
        if self.kv_offload is not None:
            self.kv_offload.close()
            self.kv_offload = None
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
        if self.arena is not None:
            self._platform.allocator(AllocatorPurpose.KV_ARENA).free(self.arena.buffer)
            self.arena = None
        if self._owns_parallel_state:
            destroy_parallel_state()
            self.parallel_state = ParallelState.single()
            self._owns_parallel_state = False

    def _init_parallel_state(self) -> None:
        """Join the (pp, pcp, dcp, tp) grid of all `world_size` ranks
        (tokenmill.distributed.parallel_state): TP groups contiguous, the context parallel
        ones strided by tp, pipeline stages outermost."""
        config = self.config
        layout = ParallelLayout.of(
            ("pp", "pcp", "dcp", "tp"), pp=config.parallel.pipeline_parallel_size,
            pcp=config.parallel.prefill_context_parallel_size, dcp=config.parallel.decode_context_parallel_size,
            tp=config.parallel.tensor_parallel_size,
        )
        if config.parallel.world_size != layout.world_size or config.dist_init_method is None:
            raise ValueError(
                f"the layout {dict(zip(layout.dims, layout.sizes))} needs world_size "
                f"{layout.world_size} (got {config.parallel.world_size}) and a dist_init_method (got "
                f"{config.dist_init_method!r})"
            )
        self.parallel_state = init_parallel_state(
            layout, self.rank, self._platform, config.dist_init_method,
            expert_parallel=config.parallel.enable_expert_parallel,
            sequence_parallel=config.parallel.enable_sequence_parallelism,
        )
        self._owns_parallel_state = True
        logger.info("rank %d: joined the grid %s", self.rank, layout.coords(self.rank))

    # ---- helpers -----------------------------------------------------------------------
    def _keep_weight(self):
        """With pipeline parallel, which checkpoint tensors this rank's stage reads."""
        config = self.config
        if config.parallel.pipeline_parallel_size == 1:
            return None
        stage = self.parallel_state.group("pp").rank_in_group
        family = family_for(self.hf_config)
        return stage_weight_filter(
            self.hf_config, config.parallel.pipeline_parallel_size, stage,
            tied=family.head_is_tied(self.hf_config), final_norm=family.final_norm,
        )

    @property
    def _platform(self) -> ActivePlatform:
        if self.platform is None:
            raise RuntimeError("Worker.init_device must run first")
        return self.platform

    @property
    def _offload(self) -> WorkerOffload:
        if self.kv_offload is None:
            raise RuntimeError("this worker has no KV offload (no kv_offload tiers configured)")
        return self.kv_offload

    @property
    def _layout(self) -> KVCacheLayout:
        if self.kv_layout is None:
            raise RuntimeError("Worker.load_model must run first")
        return self.kv_layout

    @property
    def _runner(self) -> ModelRunnerBase:
        if self.runner is None:
            raise RuntimeError("Worker.load_model must run first")
        return self.runner

    def _runner_context(self) -> ModelRunnerContext:
        config, hf_config = self.config, self.hf_config
        dtype = getattr(torch, config.dtype)
        kv_dtype = getattr(torch, config.kv_cache_dtype) if config.kv_cache_dtype else None
        specs = attention_specs_for(hf_config, dtype, config.block_size, kv_dtype)
        plan = plan_groups(specs)
        return ModelRunnerContext(
            hf_config=hf_config,
            model_path=config.model_path,
            weights=lambda: checkpoint_weights(config.model_path, hf_config, self._keep_weight(),
                                               quantization=config.quantization),
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            device=self._platform.platform.device,
            kv_cache=KVCacheSpec(
                attention_specs=tuple(specs),
                block_size=config.block_size,
                num_blocks=config.num_kv_blocks,
                num_bytes=config.kv_cache_memory_bytes,
                layer_groups=plan.layer_group,
                layer_slots=plan.layer_slot,
            ),
            parallel=dataclasses.replace(config.parallel, rank=self.rank),
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            seed=config.seed,
            active_platform=self._platform,
            parallel_state=self.parallel_state,
            quantization=config.quantization,
            spec_method=config.spec_method,
            num_speculative_tokens=config.num_speculative_tokens,
            spec_draft_model=config.spec_draft_model,
        )
