"""Parts of an LLMEngine's setup and upkeep kept out of llm_engine.py: the dtype, the
parallel layout's checks, the KV offload connection and its settling, the roofline meter,
and a step's structured-output masks."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import torch

from tokenmill.distributed.executor import Executor, UniExecutor
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.kv.groups import KVGroup
from tokenmill.kv_connector.engine_setup import (
    Offload,
    engine_offload,
    offload_config,
    remote_engine_offload,
)
from tokenmill.model.context_parallel import check_decode_context_parallel
from tokenmill.model.loader import ModelInfo, resolve_quantization
from tokenmill.model.pipeline import check_pipeline
from tokenmill.model.registry import attention_specs_for, check_sequence_parallel, family_for
from tokenmill.planner.roofline import RooflineMeter
from tokenmill.platforms.interfaces import ParallelConfig
from tokenmill.platforms.kv_messages import TierIndex, WorkerReport
from tokenmill.platforms.ops.kv_quant import KV_CACHE_DTYPES
from tokenmill.platforms.registry import ActivePlatform, PlatformError
from tokenmill.platforms.step import StructuredMasks
from tokenmill.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


def check_parallel(p: ParallelConfig, platform: ActivePlatform, hf_config: Any,
                   dtype: torch.dtype, block_size: int) -> None:
    """A bad parallel size fails here, naming it, before any process starts."""
    tp, dcp, pcp = (p.tensor_parallel_size, p.decode_context_parallel_size,
                    p.prefill_context_parallel_size)
    if p.world_size > 1 and not platform.platform.capabilities.collectives:
        raise ValueError(
            f"{p.world_size} ranks (tensor_parallel_size={tp} x pipeline_parallel_size="
            f"{p.pipeline_parallel_size} x decode_context_parallel_size={dcp} x "
            f"prefill_context_parallel_size={pcp}) need collectives; platform "
            f"{platform.name!r} declares none (capabilities.collectives)"
        )
    family = family_for(hf_config)
    if tp > 1:
        family.local_config(hf_config, tp, p.enable_expert_parallel)
        if p.enable_sequence_parallelism:
            check_sequence_parallel(hf_config)
    if dcp > 1:
        specs = attention_specs_for(hf_config, dtype, block_size)
        check_decode_context_parallel(specs, block_size, dcp)
    if p.pipeline_parallel_size > 1:
        check_pipeline(hf_config, p.pipeline_parallel_size, family.pipeline_parallel)


def connect_offload(args, executor: Executor, groups: tuple[KVGroup, ...]) -> Offload | None:
    """KV offload's engine side, or None without tiers: over the worker's own tier
    stack with the in-process executor; over a mirror of rank 0's stack, seeded from
    its index and kept up to date by its step reports, with worker processes."""
    if offload_config(args) is None:
        return None
    if isinstance(executor, UniExecutor):
        return engine_offload(executor.worker.kv_offload, args.block_size, groups)
    (data,) = executor.collective_rpc("kv_offload_index", unique_reply_rank=0)
    return remote_engine_offload(msgspec.msgpack.decode(data, type=TierIndex), groups)


def drain_offload(offload: Offload, executor: Executor) -> WorkerReport:
    """Wait for every KV load and save in flight; the report of what they did."""
    if offload.worker_side is not None:
        return offload.worker_side.drain()
    (data,) = executor.collective_rpc("kv_offload_drain", unique_reply_rank=0)
    return msgspec.msgpack.decode(data, type=WorkerReport)


def settle_offload(engine) -> None:
    """Before an idle `engine` (an LLMEngine with offload) sleeps: every save sent and
    drained, and the device's cached blocks moved to the host tier."""
    # recurrent checkpoints held for their save (kv_connector/checkpoints.py): a step
    # carries them, the drain releases them, so the prefix cache can be reset
    while engine.scheduler.connector.has_unsent_saves:
        engine.core_step()
    engine.drain_kv_offload()
    # the device's cached blocks move to the host tier (the reset evicts them; a step
    # carries the moves) before sleep discards the KV cache
    engine.kv.reset_prefix_cache()
    while engine.scheduler.connector.has_unsent_saves:
        engine.core_step()
    engine.drain_kv_offload()


def roofline_meter(engine) -> RooflineMeter | None:
    """The /metrics roofline gauges' meter, fed by the platform's hardware spec (its
    `tokenmill_hardware_spec`); None, logged, when the spec is bad."""
    try:
        spec = engine.platform.hardware_spec()
    except PlatformError as exc:
        logger.warning("no roofline gauges: %s", exc)
        return None
    return RooflineMeter.for_engine(engine.loaded.hf_config, engine.dtype, engine.args, spec,
                                    engine.device.type)


def roofline_fields(meter: RooflineMeter | None) -> dict[str, float]:
    """The meter's figures as `SchedulerStats` fields (none without a meter)."""
    if meter is None:
        return {}
    r = meter.stats
    return {"model_flops_per_s": r.flops_per_s, "flops_utilization": r.flops_utilization,
            "model_bytes_per_s": r.bytes_per_s,
            "bandwidth_utilization": r.bandwidth_utilization,
            "model_flops_total": r.flops_total, "model_bytes_total": r.bytes_total}


_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
}


def engine_quantization(args, loaded: ModelInfo, platform: ActivePlatform) -> str:
    """`args.quantization` resolved against the checkpoint (`loader.resolve_quantization`)
    and what runs it. Unset, a quantized checkpoint the engine cannot run quantized (under
    tensor parallel: quantized layers are not split over ranks yet; on a platform that
    declares no `quantized_weights`) is dequantized to the dtype, logged; asked for, that
    is a ValueError naming the value and the way out."""
    method = resolve_quantization(loaded.model_path, loaded.hf_config, args.quantization)
    if method == "none":
        return method
    blocker = None
    if args.tensor_parallel_size > 1:
        blocker = (f"tensor_parallel_size={args.tensor_parallel_size}: quantized layers "
                   "are not split over TP ranks yet")
    elif not platform.platform.capabilities.quantized_weights:
        blocker = (f"platform {platform.name!r} runs dense weights only "
                   "(Capabilities.quantized_weights)")
    if blocker is None:
        return method
    if args.quantization is None:
        logger.info("%s is quantized as %r; %s: dequantized to the dtype", loaded.model_path,
                    method, blocker)
        return "none"
    raise ValueError(f"quantization {method!r} with {blocker}; pass quantization='none' "
                     "(--quantization none: weights dequantized to dtype)")


def resolve_dtype(name: str, platform: ActivePlatform) -> torch.dtype:
    """'auto' takes the platform's proposal; an explicit dtype must be one it supports."""
    if name == "auto":
        return platform.platform.default_dtype
    dtype = _DTYPES[name]
    if dtype not in platform.platform.capabilities.dtypes:
        supported = sorted(str(d).removeprefix("torch.") for d in platform.platform.capabilities.dtypes)
        raise ValueError(f"dtype={name!r} is not supported by platform {platform.name!r}; use one of {supported}")
    return dtype


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """A torch dtype's name without the module ("bfloat16"); None stays None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def resolve_kv_cache_dtype(name: str, platform: ActivePlatform) -> torch.dtype | None:
    """'auto': None (the cache in the compute dtype); an FP8 name must be one of the
    platform's declared `Capabilities.kv_cache_dtypes`, else ValueError naming both."""
    if name == "auto":
        return None
    dtype = KV_CACHE_DTYPES[name]
    declared = platform.platform.capabilities.kv_cache_dtypes
    if dtype not in declared:
        names = sorted(n for n, d in KV_CACHE_DTYPES.items() if d in declared)
        raise ValueError(
            f"kv_cache_dtype={name!r} ({dtype_name(dtype)}) is not supported by platform "
            f"{platform.name!r}; it declares {['auto', *names]}"
        )
    return dtype


def structured_masks(structured: StructuredOutputManager, plan: SchedulerOutput) -> StructuredMasks | None:
    """This step's grammar masks for its constrained sampling rows, or None."""
    if not structured.num_requests:
        return None
    masks = structured.step_masks(
        [s.request_id for s in plan.scheduled if s.sample],
        {s.request_id: list(s.draft_token_ids) for s in plan.scheduled if s.draft_token_ids},
    )
    if masks is None:
        return None
    return StructuredMasks(
        bitmask=masks.bitmask.numpy().astype("<i4", copy=False).tobytes(),
        num_words=masks.bitmask.shape[1],
        row_indices=masks.row_indices,
        ended_rows=masks.ended_rows,
    )
