"""Engine configuration: every knob `LLM(...)` and `tokenmill serve` accept, validated."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# the parallel sizes whose product is the number of ranks (worker processes)
WORLD_SIZES = (
    "tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size",
    "prefill_context_parallel_size",
)

DType = Literal["auto", "bfloat16", "bf16", "float32", "fp32", "float16", "fp16"]


class EngineArgs(BaseModel):
    """Engine arguments. Unknown names are rejected, naming the argument."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="HF directory or .gguf file; None: the default")
    dtype: DType = "auto"
    platform: str | None = None
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    long_prefill_token_threshold: int | None = Field(
        None,
        ge=0,
        description="most prompt tokens one request computes per step; 0: no limit; "
        "None: the platform's choice (no limit if it has none)",
    )
    block_size: int = Field(16, ge=1)
    enable_prefix_caching: bool = True
    kv_eviction: Literal["benefit", "lru"] = Field(
        "benefit",
        description="which free cached KV pages go first under pressure: 'benefit' (least "
        "recompute saved per byte, every attention type and recurrent checkpoint weighed "
        "alike, aged GreedyDual-style) or 'lru' (least recently freed, vLLM's order)",
    )
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV cache size in bytes; wins over memory_utilization"
    )
    memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="share of the device's total memory (the platform's memory_info) the "
        "engine may use, weights and activations included; the KV cache gets what is left "
        "(vLLM's gpu_memory_utilization)",
    )
    distributed_executor_backend: Literal["uni", "mp", "ray"] = Field(
        "uni",
        description="uni: the worker runs in the engine's process; mp: a process per rank "
        "on this host (the default when tensor_parallel_size x pipeline_parallel_size > 1); "
        "ray: a Ray actor per rank, on the nodes of a Ray cluster",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks the model's heads, MLP and vocab are split over"
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="stages the model's layers are split over (each with "
        "tensor_parallel_size ranks)",
    )
    data_parallel_size: int = Field(
        1, ge=1, description="whole engine replicas (each of tensor_parallel_size x "
        "pipeline_parallel_size ranks) behind one front; requests go to the replica that "
        "served their prefix, else the least loaded (tokenmill.distributed.dp_router)",
    )
    decode_context_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks (beside the tensor parallel ones) each sequence's KV cache is "
        "spread over, token by token; attention merges their parts (full attention only)",
    )
    prefill_context_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks (beside the tensor parallel ones) a step's prompt tokens are split "
        "over, keys and values all-gathered in every layer",
    )
    enable_expert_parallel: bool = Field(
        False,
        description="MoE models: split the experts over the tensor parallel ranks (each "
        "expert whole on one rank, tokens dispatched to them all-to-all) instead of "
        "splitting every expert's intermediate dim",
    )
    enable_sequence_parallelism: bool = Field(
        False,
        description="with tensor_parallel_size > 1: between TP regions split the activations "
        "along the tokens (reduce-scatter after row-parallel layers, all-gather before "
        "column-parallel ones) instead of all-reducing them; llama, qwen2, qwen3",
    )
    num_kv_blocks: int | None = Field(None, ge=1, description="override the KV pool size")
    seed: int = 0
    generation_config: str = Field(
        "auto",
        description="default sampling parameters for requests that leave them unset: 'auto' "
        "(the model's generation_config.json, or tokenmill's settings for the default "
        "model), 'vllm' or 'none' (off), or a directory holding a generation_config.json",
    )
    tokenizer: str | None = None
    chat_template: str | None = None
    structured_output_cache_size: int = Field(
        256, ge=1, description="compiled grammars kept for reuse (LRU)"
    )
    structured_output_compile_timeout_s: float = Field(
        5.0, gt=0, description="a constraint that takes longer to compile is refused"
    )

    @model_validator(mode="before")
    @classmethod
    def _tp_backend(cls, data: Any) -> Any:
        """More than one rank (the product of WORLD_SIZES) needs a process per rank: 'mp'
        unless another is named."""
        if not isinstance(data, dict):
            return data
        sizes = {k: data.get(k) or 1 for k in WORLD_SIZES}
        if not all(isinstance(v, int) for v in sizes.values()) or math.prod(sizes.values()) <= 1:
            return data  # the fields' own checks report bad values
        backend = data.get("distributed_executor_backend")
        if backend is None:
            return {**data, "distributed_executor_backend": "mp"}
        if backend == "uni":
            named = " x ".join(
                f"{k}={v}" for k, v in sizes.items() if v > 1 or k == "tensor_parallel_size"
            )
            raise ValueError(
                f"{named} needs a process per rank: distributed_executor_backend='uni' runs "
                "one; use 'mp' or 'ray'"
            )
        return data

    @property
    def world_size(self) -> int:
        """Worker ranks of one engine: the product of WORLD_SIZES."""
        return math.prod(getattr(self, k) for k in WORLD_SIZES)

    # KV offload (core/kv_connector/, docs/kv-offload.md): each set tier joins the stack
    kv_offload_host_bytes: int | None = Field(
        None, description="host-memory tier size, bytes or a string like '8GiB'"
    )
    kv_offload_disk_path: str | None = Field(None, description="directory of the disk tier")
    kv_offload_disk_bytes: int | None = Field(None, description="disk tier size ('100GiB')")
    kv_offload_remote: str | None = Field(
        None, description="remote tier URL; its scheme names the tier (redis://host:6379)"
    )

    @field_validator("kv_offload_host_bytes", "kv_offload_disk_bytes", mode="before")
    @classmethod
    def _size(cls, v: int | str | None, info) -> int | None:
        from tokenmill.kv_connector.registry import parse_size

        return None if v is None else parse_size(v, info.field_name)

    @model_validator(mode="after")
    def _one_context_parallel(self) -> EngineArgs:
        if self.decode_context_parallel_size > 1 and self.prefill_context_parallel_size > 1:
            raise ValueError(
                f"decode_context_parallel_size={self.decode_context_parallel_size} and "
                f"prefill_context_parallel_size={self.prefill_context_parallel_size}: one "
                "of them at a time for now"
            )
        if self.pipeline_parallel_size > 1 and (
            self.prefill_context_parallel_size > 1 or self.enable_sequence_parallelism
        ):
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} does not combine with "
                "prefill_context_parallel_size > 1 or enable_sequence_parallelism yet"
            )
        return self

    @model_validator(mode="after")
    def _offload_tiers(self) -> EngineArgs:
        from tokenmill.kv_connector.engine_setup import offload_config

        # raises ValueError naming a bad combination
        if offload_config(self) is not None and self.world_size > 1:
            raise ValueError(
                "KV offload runs with tensor_parallel_size=1 and pipeline_parallel_size=1 for "
                "now (each rank would save and load its own shard of every block); got "
                f"{self.tensor_parallel_size} x {self.pipeline_parallel_size}"
            )
        return self

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, v: str) -> str:
        if v not in ("auto", "vllm", "none") and not (Path(v) / "generation_config.json").is_file():
            raise ValueError(
                f"generation_config={v!r} must be 'auto', 'vllm', 'none' or a directory "
                "holding a generation_config.json"
            )
        return v

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size={v} must be a power of two")
        return v

