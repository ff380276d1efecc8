"""Which model class runs which HF checkpoint, by the config's `model_type`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.model.bamba import BambaForCausalLM
from tokenmill.model.deepseek_v3 import DeepseekV3ForCausalLM
from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.model.gpt_oss import GptOssForCausalLM
from tokenmill.model.kimi_linear import KimiLinearForCausalLM
from tokenmill.model.llama import CausalLM
from tokenmill.model.mixtral import MixtralForCausalLM
from tokenmill.model.qwen3_moe import Qwen3MoeForCausalLM
from tokenmill.model.qwen3_next import Qwen3NextForCausalLM
from tokenmill.platforms.interfaces import AttentionSpec

# HF `model_type` -> class. One class covers the llama family; its module docstring says how
# the types differ. Other families have a file each. Keyed by model_type, not
# `architectures`, because the classes read their per-type switches from model_type.
_MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": CausalLM,
    "qwen2": CausalLM,
    "qwen3": CausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "kimi_linear": KimiLinearForCausalLM,
    "bamba": BambaForCausalLM,
}


def supported_model_types() -> list[str]:
    return sorted(_MODEL_TYPES)


def model_class_for(hf_config: Any) -> type[nn.Module]:
    """The class that runs `hf_config`.

    Raises ValueError naming the model type, the config's architectures and the supported list.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    architectures = list(getattr(hf_config, "architectures", None) or [])
    raise ValueError(
        f"model_type {model_type!r} (architectures {architectures}) is not supported; "
        f"supported model types: {supported_model_types()}"
    )


def attention_specs_for(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    """One attention spec per layer of `hf_config`, as its model class builds them."""
    return model_class_for(hf_config).attention_specs_for(hf_config, dtype, block_size)
