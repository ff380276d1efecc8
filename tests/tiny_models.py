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


def save_random_model(config, tokenizer, path: Path, seed: int = 0) -> Path:
    """A random model of `config` saved with `tokenizer` in `path`, its matrices drawn
    as make_tiny_model draws them (peaked logits: greedy is not decided by float noise)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_greedy(path: Path, prompt_ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation of `prompt_ids`, recomputing the whole sequence
    each token (no cache to trust)."""
    model = load_hf(path)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]
