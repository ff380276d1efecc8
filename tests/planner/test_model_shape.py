"""Model shapes read from configs against transformers' own models of the same configs
(built on the meta device: shapes only): every parameter accounted for, per family and
for the shipped public configs."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tokenmill.planner.catalog import CONFIG_DIR, model_shape, shape_of, shipped_models
from tokenmill.planner.model_shape import MixerKind, weights_bytes
from tokenmill_conformance.tiny_models import make_config

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3", "gpt_oss", "qwen3_moe", "mixtral",
            "deepseek_v3", "qwen3_next", "kimi_linear", "bamba"]


def transformers_params(config) -> int:
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_counts_transformers_parameters(arch):
    config = make_config(arch, 300)
    assert shape_of(config, arch).num_params == transformers_params(config)


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-32b", "qwen3-next-80b-a3b",
                                  "kimi-linear-48b-a3b", "gpt-oss-120b", "llama-3-70b"])
def test_shipped_configs_count_transformers_parameters(name):
    data = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    data.pop("quantization_config", None)
    if data["model_type"] == "deepseek_v3":  # 61 layers of 256 experts build slowly: 5 do
        data["num_hidden_layers"] = 5
    config = AutoConfig.for_model(**data)
    assert shape_of(config, name).num_params == transformers_params(config)


def test_shipped_models_and_their_published_sizes():
    assert shipped_models() == ["deepseek-v3", "gpt-oss-120b", "kimi-linear-48b-a3b",
                                "llama-3-70b", "qwen3-32b", "qwen3-next-80b-a3b"]
    ds = model_shape("deepseek-v3")
    # the model card: 671B total (the MTP layer apart), 37B activated
    assert ds.num_params == pytest.approx(671e9, rel=0.002)
    assert ds.active_params == pytest.approx(37e9, rel=0.02)
    assert ds.linear_bytes == pytest.approx(1.0, abs=0.001)  # fp8 checkpoint
    assert weights_bytes(ds) == pytest.approx(673e9, rel=0.01)
    kinds = {layer.mixer.kind for layer in ds.layers}
    assert kinds == {MixerKind.MLA}
    assert sum(layer.experts is None for layer in ds.layers) == 3  # first_k_dense_replace
    oss = model_shape("gpt-oss-120b")
    assert oss.num_params == pytest.approx(116.8e9, rel=0.005)
    assert oss.active_params == pytest.approx(5.1e9, rel=0.02)
    assert oss.expert_bytes == pytest.approx(0.53125) and oss.linear_bytes == 2
    kimi = model_shape("kimi-linear-48b-a3b")
    assert [layer.mixer.kind for layer in kimi.layers].count(MixerKind.KDA) == 20
    nxt = model_shape("qwen3-next-80b-a3b")
    assert [layer.mixer.kind for layer in nxt.layers].count(MixerKind.GATED_DELTA) == 36


def test_the_default_gguf_model_reads_without_weights():
    shape = model_shape(None, torch.bfloat16)
    assert shape.model_type == "llama" and shape.num_layers == 30
    assert shape.num_params == pytest.approx(134.5e6, rel=0.001)  # SmolLM2-135M, tied head


def test_unknown_model_names_what_is_accepted():
    with pytest.raises(FileNotFoundError, match="neither a shipped config.*deepseek-v3"):
        model_shape("no-such-model")
