"""Tiny randomly initialised HF models (with a real tokenizer) built in code, no hub.

The recipe lives in the conformance suite (tier T3 runs the same models on every plugin);
the core's tests use it from there and add a transformers loader.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tokenmill_conformance.tiny_models import (  # noqa: F401 (re-exported)
    CHAT_TEMPLATE,
    CORPUS,
    make_config,
    make_tiny_model,
    make_tokenizer,
)


def load_hf(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model
