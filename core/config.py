"""Engine configuration: every knob `LLM(...)` and `tokenmill serve` accept, validated."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
        """tensor_parallel_size x pipeline_parallel_size > 1 needs a process per rank: 'mp'
        unless another is named."""
        if not isinstance(data, dict):
            return data
        tp = data.get("tensor_parallel_size") or 1
        pp = data.get("pipeline_parallel_size") or 1
        if not isinstance(tp, int) or not isinstance(pp, int) or tp * pp <= 1:
            return data  # the fields' own checks report bad values
        backend = data.get("distributed_executor_backend")
        if backend is None:
            return {**data, "distributed_executor_backend": "mp"}
        if backend == "uni":
            sizes = f"tensor_parallel_size={tp}" if pp == 1 else (
                f"tensor_parallel_size={tp} x pipeline_parallel_size={pp}"
            )
            raise ValueError(
                f"{sizes} needs a process per rank: distributed_executor_backend='uni' runs "
                "one; use 'mp' or 'ray'"
            )
        return data

    @property
    def world_size(self) -> int:
        """Worker ranks of one engine: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

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

