"""A worker: one rank's device, model runner and KV cache.

Built from a plain `WorkerConfig` inside its own process (the "mp" executor) or in the
engine's (the "uni" executor). Executors drive it by method name (`collective_rpc`), in
this order: `init_device`, `load_model`, `determine_num_blocks`, `initialize_kv_cache`,
then `execute` once per step, `shutdown` last.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import torch

from tokenmill.distributed.config import WorkerConfig
from tokenmill.distributed.parallel_state import (
    ParallelLayout,
    destroy_parallel_state,
    get_parallel_state,
    init_parallel_state,
)
from tokenmill.kv.sizing import kv_cache_budget
from tokenmill.kv_connector.engine_setup import WorkerOffload, make_worker_offload
from tokenmill.model.loader import build_model, checkpoint_weights, load_model_info
from tokenmill.model.pipeline import stage_weight_filter
from tokenmill.model.registry import attention_specs_for, model_class_for
from tokenmill.platforms.interfaces import (
    AllocatorPurpose,
    KVCacheSpec,
    MemoryInfo,
    ModelRunnerBase,
    ModelRunnerContext,
    ParallelConfig,
)
from tokenmill.platforms.registry import ActivePlatform, PlatformRegistry, load_platform
from tokenmill.runner import ModelRunner
from tokenmill.sleep_mode import check_level, release_weights
from tokenmill.step import StepDescription, StepResult

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
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
        self.context: ModelRunnerContext | None = None
        self._memory_at_start: MemoryInfo | None = None
        self._owns_parallel_state = False
        self.kv_offload: WorkerOffload | None = None  # KV offload's worker half, if configured
        self._sleep_level: int | None = None  # set while asleep

    # ---- set-up, in the executor's order -----------------------------------------------
    def init_device(self) -> None:
        if self.platform is None:
            self.platform = load_platform(self.config.platform, PlatformRegistry.discover())
        if self.hf_config is None:
            self.hf_config = load_model_info(self.config.model_path, load_tokenizer=False).hf_config
        torch.manual_seed(self.config.seed)
        if self.config.world_size > 1:
            self._init_parallel_state()
        # before any weights: the KV cache is sized from what the engine adds to this
        self._memory_at_start = self.platform.platform.memory_info()

    def load_model(self) -> None:
        """Build the model runner: the plugin's own if `tokenmill_model_runner` returns one
        (asked before any weights are read; it loads its own), else the core's, with the
        checkpoint's weights loaded and the platform's decode graphs, if any."""
        platform = self._platform
        self.context = self._runner_context()
        self.runner = platform.model_runner(self.context)
        if self.runner is not None:
            logger.info("rank %d: platform %r brings its own model runner %s", self.rank,
                        platform.name, type(self.runner).__name__)
            return
        sleepy = platform.platform.capabilities.sleep_mode
        model = build_model(
            self.hf_config,
            self.context.weights(),
            dtype=self.context.dtype,
            device=self.context.device,
            ops=platform.ops,
            attention_backend=platform.attention_backend,
            block_size=self.config.block_size,
            weights_allocator=platform.allocator(AllocatorPurpose.WEIGHTS) if sleepy else None,
        )
        self.runner = ModelRunner(
            model,
            platform.allocator(AllocatorPurpose.KV_ARENA),
            self.config.block_size,
            self.context.device,
            apply_token_bitmask=platform.ops.apply_token_bitmask,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.config.max_model_len,
            graphs=self._graphs(),
        )

    def _graphs(self):
        """The platform's decode graphs; none with pipeline parallel (a captured step
        cannot hold the stage's send and receive)."""
        if self.config.pipeline_parallel_size > 1:
            logger.info("rank %d: decode graphs are off with pipeline parallel", self.rank)
            return None
        return self._platform.graph_capture(self.config.max_num_seqs)

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
            runner.profile()
            sized = kv_cache_budget(
                self._memory_at_start, self._platform.platform.memory_info(),
                config.memory_utilization,
            )
            budget, why = sized.num_bytes, sized.explanation
        allocator = self._platform.allocator(AllocatorPurpose.KV_ARENA)
        room = allocator.bytes_limit() - allocator.bytes_in_use()
        if budget > room:
            budget, why = room, f"{why}; capped by the KV allocator's {room} free bytes"
        block_bytes = runner.kv_block_bytes()
        reserved = runner.num_reserved_blocks if isinstance(runner, ModelRunner) else 0
        num_blocks = budget // block_bytes - reserved
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache gets {budget} bytes ({why}), which holds no block of "
                f"{block_bytes} bytes; raise memory_utilization, set kv_cache_memory_bytes "
                "or num_kv_blocks, or free device memory"
            )
        most = config.max_num_seqs * -(-config.max_model_len // config.block_size)
        num_blocks = min(num_blocks, most)
        logger.info("rank %d: %d KV blocks of %d bytes (%s)", self.rank, num_blocks,
                    block_bytes, why)
        return num_blocks

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block on this rank (its own KV heads only, with tensor parallel)."""
        return self._runner.kv_block_bytes()

    def parameter_bytes(self) -> int:
        """Bytes of the model parameters this rank holds (its shard, with tensor parallel);
        0 for a platform's own runner, whose weights the core does not see."""
        model = getattr(self._runner, "model", None)
        if model is None:
            return 0
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def communicated_bytes(self, dim: str) -> int:
        """Payload bytes this rank has passed through dimension `dim`'s communicator."""
        return get_parallel_state().communicated_bytes().get(dim, 0)

    def communicated_op_bytes(self, dim: str, op: str) -> int:
        """Payload bytes this rank has passed through collective `op` (a Communicator
        method name) of dimension `dim`'s communicator; 0 when it has none."""
        group = get_parallel_state().groups.get(dim)
        return 0 if group is None or group.communicator is None else group.communicator.bytes.get(op, 0)

    def uses_kv_groups(self) -> bool:
        """Whether this rank's runner keeps one block table per KV group (the core's runner
        does, core/kv/groups.py); a plugin's own runner gets one table for every layer."""
        return isinstance(self._runner, ModelRunner)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._runner.initialize_kv_cache(num_blocks)
        if self.config.kv_offload is not None:
            arena = getattr(self._runner, "arena", None)
            if arena is None:
                raise ValueError(
                    f"KV offload needs the core's model runner (its KV arena); platform "
                    f"{self._platform.name!r} brings {type(self._runner).__name__}"
                )
            self.kv_offload = make_worker_offload(
                self.config.kv_offload, self.config.model_path, self.hf_config,
                arena.page_rows(), self._platform, self.config.block_size, self.config.dtype,
            )
            if self.config.distributed_executor_backend != "uni":
                # the engine's scheduler side mirrors the stack from our reports
                self.kv_offload.stack.record_changes()
                self.kv_offload.worker_side.mirrored = True

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

    # ---- sleep mode (tokenmill.sleep_mode) ----------------------------------------------
    def sleep(self, level: int) -> int:
        """Free this rank's KV cache (contents discarded) and weights (kept in host memory
        at level 1, discarded at 2) through the platform's allocators; returns the bytes
        freed. The engine calls it only while no request is in flight."""
        level = check_level(level)
        runner = self._sleep_runner()
        if self._sleep_level is not None:
            raise RuntimeError(f"rank {self.rank} is already asleep (level {self._sleep_level})")
        platform = self._platform
        freed = runner.kv_allocator.sleep(keep_contents=False)
        freed += platform.allocator(AllocatorPurpose.WEIGHTS).sleep(keep_contents=level == 1)
        self._sleep_level = level
        logger.info("rank %d asleep (level %d): %.1f MiB freed", self.rank, level, freed / (1 << 20))
        return freed

    def wake_up(self) -> None:
        """Give the weights and the KV cache their memory back: weights restored (level 1)
        or read again from the checkpoint (level 2), the KV cache zeroed; decode graphs,
        whose addresses moved, are captured again."""
        runner = self._sleep_runner()
        if self._sleep_level is None:
            raise RuntimeError(f"rank {self.rank} is not asleep")
        self._platform.allocator(AllocatorPurpose.WEIGHTS).wake()
        runner.kv_allocator.wake()
        if self._sleep_level == 2:
            runner.model.load_weights(self.context.weights())
            runner.model.prepack()
        if runner.decode_graphs is not None:
            runner.decode_graphs.capture()
        self._sleep_level = None
        logger.info("rank %d awake", self.rank)

    def _sleep_runner(self) -> ModelRunner:
        platform = self._platform
        if not platform.platform.capabilities.sleep_mode:
            raise RuntimeError(f"platform {platform.name!r} declares no sleep mode "
                               "(capabilities.sleep_mode)")
        if not isinstance(self._runner, ModelRunner):
            raise RuntimeError(f"sleep mode needs the core's model runner; platform "
                               f"{platform.name!r} brings {type(self._runner).__name__}")
        return self._runner

    # ---- steps -------------------------------------------------------------------------
    def execute(self, step: StepDescription) -> StepResult | None:
        """Run one step; the output rank (`WorkerConfig.output_rank`: rank 0, or TP rank 0
        of the last pipeline stage) returns its result, the other ranks None."""
        connector = self.kv_offload.worker_side if self.kv_offload is not None else None
        meta = step.kv_connector
        if connector is not None and meta is not None:
            connector.start_prefetch(meta.prefetch)
            connector.start_loads(meta.loads)  # overlapped with this step's forward pass
        result = self._runner.execute(step)
        if connector is not None:
            if meta is not None:
                connector.save(meta.saves)  # the blocks this step filled, copied out now
            # a step with nothing to compute waits a little for a load to report
            result.kv_connector = connector.report(
                wait_s=0.0 if step.scheduled_request_ids else 0.005
            )
        return result if self.rank == self.config.output_rank else None

    def shutdown(self) -> None:
        if self.kv_offload is not None:
            self.kv_offload.close()
            self.kv_offload = None
        if self.runner is not None:
            self.runner.shutdown()
            buffers = getattr(getattr(self.runner, "model", None), "weight_buffers", None)
            if buffers:  # sleep mode put the weights in the platform's allocator
                release_weights(buffers, self._platform.allocator(AllocatorPurpose.WEIGHTS))
            self.runner = None
        if self._owns_parallel_state:
            destroy_parallel_state()
            self._owns_parallel_state = False

    def _init_parallel_state(self) -> None:
        """Join the (pp, pcp, dcp, tp) grid of all `world_size` ranks
        (tokenmill.distributed.parallel_state): TP groups contiguous, the context parallel
        ones strided by tp, pipeline stages outermost."""
        config = self.config
        layout = ParallelLayout.of(
            ("pp", "pcp", "dcp", "tp"), pp=config.pipeline_parallel_size,
            pcp=config.prefill_context_parallel_size, dcp=config.decode_context_parallel_size,
            tp=config.tensor_parallel_size,
        )
        if config.world_size != layout.world_size or config.dist_init_method is None:
            raise ValueError(
                f"the layout {dict(zip(layout.dims, layout.sizes))} needs world_size "
                f"{layout.world_size} (got {config.world_size}) and a dist_init_method (got "
                f"{config.dist_init_method!r})"
            )
        init_parallel_state(
            layout, self.rank, self._platform, config.dist_init_method,
            expert_parallel=config.enable_expert_parallel,
            sequence_parallel=config.enable_sequence_parallelism,
        )
        self._owns_parallel_state = True
        logger.info("rank %d: joined the grid %s", self.rank, layout.coords(self.rank))

    # ---- helpers -----------------------------------------------------------------------
    def _keep_weight(self):
        """With pipeline parallel, which checkpoint tensors this rank's stage reads."""
        config = self.config
        if config.pipeline_parallel_size == 1:
            return None
        stage = get_parallel_state().group("pp").rank_in_group
        tied = model_class_for(self.hf_config).head_is_tied(self.hf_config)
        return stage_weight_filter(self.hf_config, config.pipeline_parallel_size, stage, tied=tied)

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
    def _runner(self) -> ModelRunnerBase:
        if self.runner is None:
            raise RuntimeError("Worker.load_model must run first")
        return self.runner

    def _runner_context(self) -> ModelRunnerContext:
        config, hf_config = self.config, self.hf_config
        dtype = getattr(torch, config.dtype)
        return ModelRunnerContext(
            hf_config=hf_config,
            model_path=config.model_path,
            weights=lambda: checkpoint_weights(config.model_path, hf_config, self._keep_weight()),
            dtype=dtype,
            device=self._platform.platform.device,
            kv_cache=KVCacheSpec(
                attention_specs=tuple(attention_specs_for(hf_config, dtype, config.block_size)),
                block_size=config.block_size,
                num_blocks=config.num_kv_blocks,
                num_bytes=config.kv_cache_memory_bytes,
            ),
            parallel=ParallelConfig(
                world_size=config.world_size,
                rank=self.rank,
                distributed_executor_backend=config.distributed_executor_backend,
                tensor_parallel_size=config.tensor_parallel_size,
                pipeline_parallel_size=config.pipeline_parallel_size,
                enable_expert_parallel=config.enable_expert_parallel,
                enable_sequence_parallelism=config.enable_sequence_parallelism,
                decode_context_parallel_size=config.decode_context_parallel_size,
                prefill_context_parallel_size=config.prefill_context_parallel_size,
            ),
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            seed=config.seed,
        )
