"""The core's model runner as a plugin: the `model_runner` kind's `tokenmill` entry.

Announced in the core's pyproject.toml (entry point group `tokenmill.model_runners`) and
asked through the same hook as a platform's own runner, after it: a platform plugin that
brings a runner for a model wins; every other model gets this one, which builds the
core's torch graph with the platform's attention backends, ops, allocators and graphs.
"""

from __future__ import annotations

import logging

import pluggy
import torch

from tokenmill.model.loader import build_model, quant_schemes
from tokenmill.platforms.interfaces import (
    AllocatorPurpose,
    ModelRunnerBase,
    ModelRunnerContext,
    Platform,
)
from tokenmill.spec_decode.draft_models import build_draft
from tokenmill.worker.drafting import DraftProposer
from tokenmill.worker.runner import ModelRunner

hookimpl = pluggy.HookimplMarker("tokenmill")
logger = logging.getLogger(__name__)


@hookimpl
def tokenmill_api_version() -> str:
    return "1.6"


@hookimpl
def tokenmill_model_runner(platform: Platform, context: ModelRunnerContext) -> ModelRunnerBase:
    """The core's runner over `context.active_platform`: the checkpoint's weights loaded
    (into the platform's WEIGHTS allocator when it declares sleep mode), the platform's
    decode graphs unless pipeline parallel (a captured step cannot hold a stage's send
    and receive)."""
    active = context.active_platform
    sleepy = platform.capabilities.sleep_mode
    weights_allocator = active.allocator(AllocatorPurpose.WEIGHTS) if sleepy else None
    model = build_model(
        context.hf_config,
        context.weights(),
        dtype=context.dtype,
        device=context.device,
        ops=active.ops,
        attention_backend=active.attention_backend,
        block_size=context.kv_cache.block_size,
        weights_allocator=weights_allocator,
        parallel=context.parallel_state,
        schemes=quant_schemes(context.model_path, context.hf_config, context.quantization,
                              context.dtype),
        kv_cache_dtype=context.kv_cache_dtype,
    )
    graphs = None
    draft = _draft_proposer(context, model)
    if context.parallel.pipeline_parallel_size > 1:
        logger.info("rank %d: decode graphs are off with pipeline parallel", context.parallel.rank)
    else:
        graphs = active.graph_capture(context.max_num_seqs)
    return ModelRunner(
        model,
        context.kv_cache.block_size,
        context.device,
        apply_token_bitmask=active.ops.apply_token_bitmask,
        max_num_batched_tokens=context.max_num_batched_tokens,
        max_num_seqs=context.max_num_seqs,
        max_model_len=context.max_model_len,
        graphs=graphs,
        weights_allocator=weights_allocator,
        reload_weights=context.weights if weights_allocator is not None else None,
        draft=draft,
    )


def _draft_proposer(context: ModelRunnerContext, model: torch.nn.Module) -> DraftProposer | None:
    """Model-based speculative decoding's draft model beside `model`, or None."""
    method = context.spec_method
    if method is None:
        return None
    active, block_size = context.active_platform, context.kv_cache.block_size
    draft = build_draft(method, model, context.model_path, context.spec_draft_model,
                        context.parallel_state, active.attention_backend, context.device,
                        block_size)
    logger.info("rank %d: %s draft model for speculative decoding, %d drafts per step",
                context.parallel.rank, method, context.num_speculative_tokens)
    return DraftProposer(draft, context.num_speculative_tokens, block_size, context.device)
