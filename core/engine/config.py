"""Engine configuration: every knob `LLM(...)` and `tokenmill serve` accept, validated
(`EngineArgs`), and what they resolve to, once (`EngineConfig`): the one configuration
the engine's workers, executors and model runners read, parallel sizes written once in
the contract's `ParallelConfig`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from tokenmill.kv_connector.registry import OffloadConfig
from tokenmill.platforms.model_runner import ParallelConfig
from tokenmill.spec_decode.config import SpeculativeConfig

# the parallel sizes whose product is the number of ranks (worker processes)
WORLD_SIZES = (
    "tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size",
    "prefill_context_parallel_size",
)

DType = Literal["auto", "bfloat16", "bf16", "float32", "fp32", "float16", "fp16"]
# vLLM's names (tokenmill.platforms.ops.kv_quant.KV_CACHE_DTYPES); auto: the compute dtype
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]


class EngineArgs(BaseModel):
    """Engine arguments. Unknown names are rejected, naming the argument."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="HF directory or .gguf file; None: the default")
    dtype: DType = "auto"
    quantization: Literal["none", "gguf", "awq", "gptq", "fp8"] | None = Field(
        None,
        description="how the weights are held (vLLM's names): gguf, awq, gptq, fp8 keep the "
        "checkpoint's quantized layers quantized; none dequantizes them to dtype; None: "
        "what the checkpoint is (docs/quantization.md)",
    )
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
    kv_cache_dtype: KVCacheDType = Field(
        "auto",
        description="what the KV cache stores: 'auto' (the compute dtype) or FP8 ('fp8' = "
        "'fp8_e4m3', 'fp8_e5m2'; vLLM's names), half the bytes per token, so twice the "
        "tokens in the same pool; scales per layer from the checkpoint, else 1.0; the "
        "platform must declare the dtype (Capabilities.kv_cache_dtypes); recurrent state "
        "keeps its own dtype (docs/quantized-kv.md)",
    )
    calculate_kv_scales: bool = Field(
        False,
        description="with an FP8 kv_cache_dtype: set each attention layer's k / v scales "
        "per KV head to amax / the format's largest value, measured at start by a prefill "
        "of a fixed sample (Python stdlib sources) in the compute dtype, instead of 1.0; "
        "scales a checkpoint carries win; ignored (logged) with kv_cache_dtype 'auto', as "
        "in vLLM (docs/quantized-kv.md)",
    )
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
        "served their prefix, else the least loaded (tokenmill.frontend.dp_router)",
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
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description="speculative decoding, vLLM's shape: {\"method\": \"suffix\" | \"ngram\" "
        "| \"mtp\" | \"eagle3\", \"num_speculative_tokens\": k, ...} (docs/speculative.md)",
    )

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative(cls, v: Any) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(v)

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

    def parallel_config(self) -> ParallelConfig:
        """The parallel sizes and executor, as every rank, executor and runner reads them
        (the engine's view: rank 0; a worker replaces the rank with its own)."""
        return ParallelConfig(
            world_size=self.world_size,
            distributed_executor_backend=self.distributed_executor_backend,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            enable_sequence_parallelism=self.enable_sequence_parallelism,
            decode_context_parallel_size=self.decode_context_parallel_size,
            prefill_context_parallel_size=self.prefill_context_parallel_size,
        )

    # KV offload (core/kv_connector/, docs/kv-offload.md): each set tier joins the stack
    kv_offload_host_bytes: int | None = Field(
        None, description="host-memory tier size, bytes or a string like '8GiB'"
    )
    kv_offload_disk_path: str | None = Field(None, description="directory of the disk tier")
    kv_offload_disk_bytes: int | None = Field(None, description="disk tier size ('100GiB')")
    kv_offload_remote: str | None = Field(
        None, description="remote tier URL; its scheme names the tier (redis://host:6379)"
    )
    kv_offload_hmac_key: SecretStr | None = Field(
        None, description="objects in shared tiers (disk, Redis, Mooncake) carry an "
        "HMAC-SHA256 tag under this key; a forged or untagged one is never loaded",
    )

    # prefill/decode disaggregation (core/kv_connector/handover/, docs/disaggregation.md)
    kv_role: Literal["both", "prefill", "decode"] = Field(
        "both", description="prefill: computes prompts and holds their KV for decode "
        "instances; decode: continues them from the pulled KV; both: either, and colocated"
    )
    kv_transport: str | None = Field(
        None, description="KV transport plugin for handovers (nixl, mooncake); default: the "
        "first installed of mooncake, nixl, when kv_role is prefill or decode"
    )
    kv_lease_s: float = Field(
        30.0, gt=0, description="seconds a prefill engine holds a computed prompt's KV for "
        "its decode engine before freeing it"
    )
    kv_pull_timeout_s: float = Field(
        20.0, gt=0, description="seconds a decode engine waits for a pull before computing "
        "the prompt itself"
    )

    @field_validator("kv_offload_host_bytes", "kv_offload_disk_bytes", mode="before")
    @classmethod
    def _size(cls, v: int | str | None, info) -> int | None:
        from tokenmill.platforms.kv_tier import parse_size

        return None if v is None else parse_size(v, info.field_name)

    @model_validator(mode="after")
    def _one_context_parallel(self) -> EngineArgs:
        if self.decode_context_parallel_size > 1 and self.prefill_context_parallel_size > 1:
            raise ValueError(
                f"decode_context_parallel_size={self.decode_context_parallel_size} and "
                f"prefill_context_parallel_size={self.prefill_context_parallel_size}: one "
                "of them at a time for now"
            )
        if self.speculative_config is not None and self.pipeline_parallel_size > 1:
            raise ValueError(
                f"speculative_config with pipeline_parallel_size={self.pipeline_parallel_size}: "
                "steps in flight would verify drafts of tokens not yet sampled; use one stage"
            )
        if self.kv_cache_dtype != "auto" and self.decode_context_parallel_size > 1:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} with decode_context_parallel_size="
                f"{self.decode_context_parallel_size}: decode context parallel's partial "
                "attention reads an unquantized cache; use kv_cache_dtype='auto' there"
            )
        spec = self.speculative_config
        if self.kv_cache_dtype != "auto" and spec is not None and spec.method in ("mtp", "eagle3"):
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} with speculative method "
                f"{spec.method!r}: the draft model's layers cache in the compute dtype; use "
                "kv_cache_dtype='auto', or the suffix / ngram methods"
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


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """EngineArgs resolved, once, by the engine (no 'auto' left): what every worker is
    built from (msgspec: it crosses to worker processes as msgpack)."""

    model_path: str  # the resolved checkpoint: an HF directory or a .gguf file
    platform: str  # the platform plugin's name (entry point), as the engine chose it
    dtype: str  # torch dtype name, e.g. "bfloat16"
    block_size: int
    # the weights' quantization, resolved against the checkpoint (loader.resolve_quantization)
    quantization: str = "none"
    # torch dtype name of what the KV cache stores, e.g. "float8_e4m3fn" (EngineArgs.
    # kv_cache_dtype resolved against the platform); None: the compute dtype
    kv_cache_dtype: str | None = None
    # calculate_kv_scales: the sample's token ids every worker calibrates the quantized KV
    # cache's scales on before its arena exists (tokenmill.engine.kv_calibration); empty:
    # no calibration (scales from the checkpoint, else 1.0)
    kv_calibration_token_ids: tuple[int, ...] = ()
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int  # the model's context, before the KV pool may lower it
    seed: int
    num_kv_blocks: int | None = None  # EngineArgs.num_kv_blocks: fixes the pool size
    kv_cache_memory_bytes: int | None = None  # EngineArgs.kv_cache_memory_bytes: wins
    memory_utilization: float = 0.9  # share of the device memory_info's total to use
    # every parallel size and the executor backend (EngineArgs.parallel_config)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    dist_init_method: str | None = None  # torch.distributed rendezvous, e.g. tcp://host:port
    kv_offload: OffloadConfig | None = None  # KV offload tiers (core/kv_connector); None: off
    # P/D disaggregation: the KV transport each rank registers its arena with (None: off),
    # and the engine's id (its ranks' transport agents are named after it)
    kv_transport: str | None = None
    engine_id: str = ""
    # model-based speculative decoding (core/worker/drafting.py): "mtp" | "eagle3" | None
    spec_method: str | None = None
    num_speculative_tokens: int = 0
    spec_draft_model: str | None = None  # eagle3: the draft head's checkpoint directory

    @property
    def output_rank(self) -> int:
        """The rank that returns step results: the first rank of the last pipeline stage
        (the one that samples); rank 0 without pipeline parallel. Stages are outermost in
        the (pp, pcp, dcp, tp) grid."""
        p = self.parallel
        per_stage = (
            p.tensor_parallel_size * p.decode_context_parallel_size
            * p.prefill_context_parallel_size
        )
        return (p.pipeline_parallel_size - 1) * per_stage
