"""The plain configuration a worker is built from (msgspec: it crosses to worker processes)."""

from __future__ import annotations

import msgspec

from tokenmill.kv_connector.registry import OffloadConfig


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker needs of EngineArgs, resolved by the engine core (no 'auto' left)."""

    model_path: str  # the resolved checkpoint: an HF directory or a .gguf file
    platform: str  # the platform plugin's name (entry point), as the engine chose it
    dtype: str  # torch dtype name, e.g. "bfloat16"
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int  # the model's context, before the KV pool may lower it
    seed: int
    num_kv_blocks: int | None = None  # EngineArgs.num_kv_blocks: fixes the pool size
    kv_cache_memory_bytes: int | None = None  # EngineArgs.kv_cache_memory_bytes: wins
    memory_utilization: float = 0.9  # share of the device memory_info's total to use
    world_size: int = 1
    distributed_executor_backend: str = "uni"
    tensor_parallel_size: int = 1  # ranks of one TP group (contiguous ranks)
    pipeline_parallel_size: int = 1  # pipeline stages; world_size = pp * tp
    enable_expert_parallel: bool = False  # MoE experts split over the TP group's ranks
    enable_sequence_parallelism: bool = False  # activations split by token between TP regions
    decode_context_parallel_size: int = 1  # ranks a sequence's KV is spread over (x tp)
    prefill_context_parallel_size: int = 1  # ranks a step's tokens are split over (x tp)
    dist_init_method: str | None = None  # torch.distributed rendezvous, e.g. tcp://host:port
    kv_offload: OffloadConfig | None = None  # KV offload tiers (core/kv_connector); None: off

    @property
    def output_rank(self) -> int:
        """The rank that returns step results: the first rank of the last pipeline stage
        (the one that samples); rank 0 without pipeline parallel. Stages are outermost in
        the (pp, pcp, dcp, tp) grid."""
        per_stage = (
            self.tensor_parallel_size * self.decode_context_parallel_size
            * self.prefill_context_parallel_size
        )
        return (self.pipeline_parallel_size - 1) * per_stage
