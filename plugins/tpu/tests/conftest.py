"""The tpu plugin's JAX tests run on JAX's CPU backend with four devices.

They need `JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4` set
before JAX starts, so they run in a process of their own: tests/test_tpu_plugin.py
starts it (and CI through it). Run directly:

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        pytest -q plugins/tpu/tests
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from tokenmill_tpu.detect import forced_cpu_device_count, requested_platforms

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config: pytest.Config) -> None:
    if requested_platforms()[:1] != ["cpu"] or forced_cpu_device_count() < 4:
        raise pytest.UsageError(
            "plugins/tpu/tests need JAX_PLATFORMS=cpu and "
            "XLA_FLAGS=--xla_force_host_platform_device_count=4 (see conftest.py)"
        )


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """arch -> (HF config, HF-named weights, path) of the conformance suite's tiny models."""
    from tokenmill_conformance.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = make_tiny_model(root / arch, arch)
            weights = load_file(str(path / "model.safetensors"))
            cache[arch] = (AutoConfig.from_pretrained(path), weights, path)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def hf_greedy(tiny):
    """transformers' own greedy tokens for (arch, prompt, max_tokens), float32."""
    from transformers import AutoModelForCausalLM

    models = {}

    def run(arch: str, prompt: list[int], max_tokens: int) -> list[int]:
        if arch not in models:
            models[arch] = AutoModelForCausalLM.from_pretrained(tiny(arch)[2], dtype=torch.float32)
        out = models[arch].generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                    do_sample=False)
        return out[0, len(prompt):].tolist()

    return run
