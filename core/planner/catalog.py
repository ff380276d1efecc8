"""Which model `--model` names: a shipped public config, a config.json, an HF directory, a
GGUF file, or (nothing) the engine's default model. No weights are read.

The shipped configs (`configs/*.json`, sources in configs/SOURCES.md) are the published
config.json files of the models the planner's proofs use, so a plan for DeepSeek-V3 on 16
B200s needs neither the checkpoint nor a hub.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from tokenmill.planner.model_shape import ModelShape, shape_from_config

CONFIG_DIR = Path(__file__).parent / "configs"
BLOCK_SIZE = 16  # the block size the family's specs are asked at (page bytes scale with it)


def shipped_models() -> list[str]:
    """Names of the shipped public configs (`tokenmill plan --model deepseek-v3`)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def hf_config_of(model: str | None) -> tuple[Any, str]:
    """(transformers config, display name) of `model`; raises FileNotFoundError / ValueError
    naming it and what is accepted."""
    from transformers import AutoConfig

    from tokenmill.model.loader import default_model_path, load_model_info

    if model is None or model == "default":
        path = default_model_path()
        return load_model_info(path, load_tokenizer=False).hf_config, "SmolLM2-135M-Instruct"
    shipped = CONFIG_DIR / f"{model.lower()}.json"
    if shipped.is_file():
        return AutoConfig.for_model(**json.loads(shipped.read_text())), model
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".json":
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise ValueError(f"{model!r} has no 'model_type'; pass an HF config.json")
        return AutoConfig.for_model(**data), path.parent.name or path.stem
    if path.exists():
        return load_model_info(str(path), load_tokenizer=False).hf_config, path.name
    raise FileNotFoundError(
        f"--model {model!r} is neither a shipped config ({', '.join(shipped_models())}) nor "
        "a config.json, an HF directory or a .gguf file"
    )


def model_shape(model: str | None, dtype: torch.dtype = torch.bfloat16,
                weight_bytes: float | None = None) -> ModelShape:
    """The `ModelShape` of `model` at activation dtype `dtype` (KV cache in it too)."""
    hf_config, name = hf_config_of(model)
    return shape_of(hf_config, name, dtype, weight_bytes)


def shape_of(hf_config: Any, name: str, dtype: torch.dtype = torch.bfloat16,
             weight_bytes: float | None = None) -> ModelShape:
    from tokenmill.model.registry import attention_specs_for, family_for

    specs = attention_specs_for(hf_config, dtype, BLOCK_SIZE)
    tied = family_for(hf_config).head_is_tied(hf_config)  # the family's rule
    return shape_from_config(hf_config, specs, name, dtype.itemsize, weight_bytes, tied)


@lru_cache(maxsize=8)
def shipped_shape(name: str) -> ModelShape:
    """A shipped model's shape (cached: the search reads it many times)."""
    return model_shape(name)
