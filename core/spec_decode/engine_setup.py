"""Wiring speculative decoding into an engine: the draft model's check against the target,
the fields its workers need, and the engine core's side (drafter + scheduling)."""

from __future__ import annotations

import logging
from typing import Any

from tokenmill.model.loader import load_model_info
from tokenmill.planner.roofline import RooflineMeter
from tokenmill.spec_decode.draft_models import MODEL_METHODS, check_draft
from tokenmill.spec_decode.drafter import Drafter
from tokenmill.spec_decode.scheduling import SpecDecodeScheduling

logger = logging.getLogger(__name__)


def draft_config(args, hf_config: Any) -> Any | None:
    """A model-based method's check against the target `hf_config`, and an EAGLE-3 head's
    config (None otherwise); ValueError naming what does not fit."""
    config = args.speculative_config
    if config is None or config.method not in MODEL_METHODS:
        return None
    if args.world_size > 1:
        raise ValueError(
            f"speculative method {config.method!r} builds its draft model on one rank; "
            f"world_size={args.world_size} (tensor / pipeline / context parallel) is "
            "not supported with it yet: use suffix or ngram there"
        )
    draft = None
    if config.method == "eagle3":
        draft = load_model_info(config.model, load_tokenizer=False).hf_config
    check_draft(config.method, hf_config, draft)
    return draft


def worker_spec_fields(args) -> dict:
    """The `EngineConfig` fields a model-based method's workers build the draft from."""
    config = args.speculative_config
    if config is None or config.method not in MODEL_METHODS:
        return {}
    return {"spec_method": config.method,
            "num_speculative_tokens": config.num_speculative_tokens,
            "spec_draft_model": config.model}


def speculation(engine) -> SpecDecodeScheduling | None:
    """Speculative decoding's engine-core side for `engine` (an LLMEngine whose executor,
    KV manager, scheduler, structured outputs and roofline meter are set up), or None.
    Shuts the executor down and raises ValueError when its workers cannot verify drafts."""
    config = engine.args.speculative_config
    if config is None:
        return None
    if not all(engine.executor.collective_rpc("verifies_drafts")):
        engine.executor.shutdown()
        raise ValueError(
            f"speculative_config needs the core's model runner (it verifies drafts); "
            f"platform {engine.platform.name!r} brings its own"
        )
    drafter = Drafter(config, decode_cost_prior(engine.roofline))
    drafter.validate = engine.structured.valid_drafts
    spec = SpecDecodeScheduling(drafter, engine.kv, config.num_speculative_tokens)
    engine.scheduler.spec = spec
    logger.info("speculative decoding: %s, up to %d drafts per request per step%s",
                config.method, config.num_speculative_tokens,
                ", adaptive" if config.adaptive else "")
    return spec


def decode_cost_prior(roofline: RooflineMeter | None) -> tuple[tuple[int, float], ...]:
    """Roofline seconds of a decode step of 1 and of 256 rows at a 1k context (the
    adaptive planner's prior); empty without the platform's hardware spec."""
    if roofline is None:
        return ()
    out = []
    for rows in (1, 256):
        flops, moved = roofline.step_cost([(1024, 1)] * rows, rows)
        out.append((rows, max(flops / roofline.peak, moved / roofline.bandwidth)))
    return tuple(out)
