"""Adding a model family touches one file: this one.

Granite (HF model_type "granite"), which the core does not ship, is defined here whole:
llama's layers plus Granite's four multipliers (the embedding scaled by
`embedding_multiplier`, each branch by `residual_multiplier` before its residual add,
attention scaled by `attention_multiplier`, logits divided by `logits_scaling`), its
`ModelFamily` descriptor with its tiny-config rule, and nothing else. It is registered as
an outside distribution registers one, through an entry point of the group
`tokenmill.model_families` (a dist-info written beside this test and put on the path, so
that the spawned worker processes find it too), and served end to end on one process
and with tensor parallel 2 x pipeline parallel 2, greedy equal to transformers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import hf_greedy, save_random_model
from transformers import GraniteConfig

from tokenmill import LLM, SamplingParams
from tokenmill.model.base import CausalLM, attention_specs
from tokenmill.model.families.llama import DecoderLayer, Model
from tokenmill.model.family import ModelFamily, shrink_config
from tokenmill.model.layers import add_norm
from tokenmill.model.registry import family_for, supported_model_types
from tokenmill.platforms.interfaces import AttentionSpec
from tokenmill_conformance.tiny_models import make_tokenizer


class GraniteDecoderLayer(DecoderLayer):
    """llama's layer, each branch scaled by `residual_multiplier` before its add (the
    next norm adds it to the residual stream)."""

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, *args, **kwargs)
        self.residual_multiplier = hf_config.residual_multiplier

    def forward(self, positions, hidden, residual, kv_cache, metadata):
        hidden, residual = add_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteModel(Model):
    layer_cls = GraniteDecoderLayer

    def setup(self, hf_config: Any, specs: list[AttentionSpec], build: Any) -> None:
        super().setup(hf_config, specs, build)
        self.embedding_multiplier = hf_config.embedding_multiplier

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(CausalLM):
    body_cls = GraniteModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.hf_config.logits_scaling


def granite_specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    scale = hf_config.attention_multiplier
    return [dataclasses.replace(s, scale=scale) for s in attention_specs(hf_config, dtype, block_size)]


def tiny(hf_config: Any) -> Any:
    return shrink_config(
        hf_config, num_hidden_layers=4, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.2,
        logits_scaling=2.0,
    )


FAMILY = ModelFamily(
    name="granite",
    model_types=("granite",),
    model=GraniteForCausalLM,
    attention_specs=granite_specs,
    tiny=tiny,
)

# --- the test: register as a distribution would, serve, compare ---------------------

PROMPTS = ["The quick brown fox", "Paris is the capital of France; Berlin is"]
NEW_TOKENS = 6


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """An installed distribution whose entry point names this module's FAMILY (the
    directory goes on sys.path, which spawned worker processes inherit)."""
    dist_info = tmp_path / "site" / "tokenmill_granite_test-0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tokenmill-granite-test\nVersion: 0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[tokenmill.model_families]\ngranite = {__name__}:FAMILY\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return tmp_path


def _tiny_granite(path: Path) -> Path:
    tokenizer = make_tokenizer(300)
    config = FAMILY.tiny(GraniteConfig(vocab_size=len(tokenizer), pad_token_id=0,
                                       bos_token_id=None, eos_token_id=2))
    return save_random_model(config, tokenizer, path)


def _serve(path: Path, **parallel: Any) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(str(path), dtype="float32", block_size=4, platform="cpu", num_kv_blocks=64,
              max_num_batched_tokens=16, enable_prefix_caching=False, **parallel)
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return prompts, [o.outputs[0].token_ids for o in outs]
    finally:
        llm.engine.shutdown()


def test_granite_is_unknown_until_registered(tmp_path):
    config = GraniteConfig()
    assert "granite" not in supported_model_types()
    with pytest.raises(ValueError, match="model_type 'granite'"):
        family_for(config)


@pytest.mark.long  # four processes
def test_granite_from_one_file_serves_like_transformers_with_tp2_x_pp2(registered):
    assert family_for(GraniteConfig()) is FAMILY
    path = _tiny_granite(registered / "granite")
    prompts, alone = _serve(path)
    assert alone == [hf_greedy(path, p, NEW_TOKENS) for p in prompts]
    _, split = _serve(path, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert split == alone
