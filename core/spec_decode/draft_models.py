"""Building the draft models of model-based speculative decoding (`mtp`: the
checkpoint's multi-token-prediction module; `eagle3`: an EAGLE-3 draft head beside the
target), run on the workers beside the target (core/worker/drafting.py). Each family names
its own draft classes in its descriptor (`ModelFamily.mtp`, `ModelFamily.eagle3`, in the
family's file); what they share is core/model/draft.py; docs/speculative.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.model.base import DecoderModel
from tokenmill.model.draft import eagle3_specs, mtp_layers
from tokenmill.model.layers import BackendChoice
from tokenmill.model.registry import families, family_for
from tokenmill.platforms.interfaces import AttentionSpec

# ---- building ---------------------------------------------------------------------------------
MODEL_METHODS = ("mtp", "eagle3")


def _draft_class(method: str, hf_config: Any) -> type | None:
    """The family's draft class for `method` (its descriptor's `mtp` / `eagle3`)."""
    try:
        family = family_for(hf_config)
    except ValueError:
        return None
    return family.mtp if method == "mtp" else family.eagle3


def _families_with(method: str) -> list[str]:
    return sorted(t for t, f in families().items() if getattr(f, method) is not None)


def check_draft(method: str, hf_config: Any, draft_config: Any | None) -> None:
    """ValueError naming what is missing when `method` cannot draft for this target."""
    if method == "mtp":
        if _draft_class("mtp", hf_config) is None:
            raise ValueError(
                f"speculative method 'mtp' runs the MTP module of {_families_with('mtp')}; "
                f"model type {hf_config.model_type!r} is not supported"
            )
        if not mtp_layers(hf_config):
            raise ValueError("speculative method 'mtp': the checkpoint's config declares no "
                             "MTP module (num_nextn_predict_layers is 0)")
    elif method == "eagle3" and _draft_class("eagle3", hf_config) is None:
        raise ValueError(f"speculative method 'eagle3' drafts for targets of "
                         f"{_families_with('eagle3')}; model type "
                         f"{hf_config.model_type!r} is not supported")


def draft_attention_specs(method: str | None, hf_config: Any, draft_config: Any | None,
                          dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    """The KV layers a draft model adds after the target's (none without one)."""
    if method == "mtp":
        return _draft_class("mtp", hf_config).specs(hf_config, dtype, block_size)
    if method == "eagle3":
        return eagle3_specs(draft_config, dtype, block_size)
    return []


def build_draft(method: str, target: nn.Module, target_path: str, draft_path: str | None,
                parallel: Any, attention_backend: BackendChoice, device: torch.device,
                block_size: int) -> nn.Module:
    """The draft model of `method` beside `target` (a built CausalLM), weights loaded."""
    from tokenmill.model.loader import checkpoint_weights, load_model_info

    hf_config = target.hf_config
    build = target._layer_builder(hf_config, parallel, target.ops, target.dtype, None, False)
    with torch.device(device):
        if method == "mtp":
            check_draft(method, hf_config, None)
            cls = _draft_class("mtp", hf_config)
            draft = cls(hf_config, build, attention_backend, block_size)
            weights = checkpoint_weights(target_path, hf_config,
                                         keep=cls.weight_filter(hf_config))
        elif method == "eagle3":
            draft_config = load_model_info(draft_path, load_tokenizer=False).hf_config
            check_draft(method, hf_config, draft_config)
            draft = _draft_class("eagle3", hf_config)(draft_config, hf_config, build,
                                                      attention_backend, block_size)
            weights = checkpoint_weights(draft_path, draft_config)
        else:
            raise ValueError(f"speculative method {method!r} has no draft model")
    draft.load_weights(weights)
    draft.attach(target)
    if method == "eagle3":
        if type(target.model).forward is not DecoderModel.forward:
            raise ValueError(f"eagle3 reads the target's layer inputs; the "
                             f"{hf_config.model_type!r} family's forward does not keep them")
        target.model.aux_layers = draft.aux_layers
    draft.prepack()
    draft.eval()
    return draft
