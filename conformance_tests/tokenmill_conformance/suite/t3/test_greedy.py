"""T3 end to end: greedy outputs on the plugin equal the reference platform's, token for
token, on a tiny random model of every architecture the core supports; with chunked
prefill mixed into decodes and with prefix caching."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.registry import supported_model_types
from tokenmill.sampling_params import SamplingParams
from tokenmill_conformance.session import REFERENCE_NAME
from tokenmill_conformance.tiny_models import VARIANTS, make_tiny_model

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "héllo wörld, naïve café, 你好世界 🙂 and then some more words to make this one long",
    "def main():",
]
ARCHS = [variant for t in supported_model_types() for variant in VARIANTS.get(t, ())]
UNCOVERED = [t for t in supported_model_types() if t not in VARIANTS]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHS}


def _settings(active) -> dict:
    caps = active.platform.capabilities
    dtype = torch.float32 if torch.float32 in caps.dtypes else active.platform.default_dtype
    block = min(caps.block_sizes, key=lambda s: abs(s - 4))
    # a small KV pool: the default (2 GiB) takes longer to zero than the test to run
    return {"dtype": str(dtype).removeprefix("torch."), "block_size": block, "num_kv_blocks": 256}


def _greedy(conformance, path, platform: str, max_tokens: int = 8, **engine_args):
    from tokenmill import LLM

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(str(path), platform=platform, registry=conformance.registry, **engine_args)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference_tokens(conformance, active, tiny_dirs):
    """The reference platform's greedy tokens per architecture, computed once."""
    cache: dict[str, list[list[int]]] = {}

    def tokens(arch: str) -> list[list[int]]:
        if arch not in cache:
            settings = _settings(active)
            cache[arch] = _greedy(conformance, tiny_dirs[arch], REFERENCE_NAME, **settings)
        return cache[arch]

    return tokens


def _compare(got: list[list[int]], expected: list[list[int]]) -> None:
    for prompt, g, e in zip(PROMPTS, got, expected):
        assert g == e, f"prompt {prompt!r}: plugin {g} != reference {e}"


def test_every_supported_architecture_has_a_tiny_model():
    assert not UNCOVERED, f"the core supports model types {UNCOVERED}; the suite has no tiny model"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_reference(conformance, active, tiny_dirs, reference_tokens, arch):
    settings = _settings(active)
    expected = reference_tokens(arch)
    got = _greedy(conformance, tiny_dirs[arch], active.name, **settings)
    _compare(got, expected)


@pytest.mark.parametrize("arch", ["qwen3"])
def test_chunked_prefill_mixed_with_decodes(
    conformance, active, tiny_dirs, reference_tokens, arch
):
    settings = _settings(active)
    expected = reference_tokens(arch)
    got = _greedy(
        conformance, tiny_dirs[arch], active.name,
        max_num_batched_tokens=8, max_num_seqs=3, **settings,
    )
    _compare(got, expected)


def test_prefix_cache_hits_give_the_same_tokens(conformance, active, tiny_dirs):
    from tokenmill import LLM

    settings = _settings(active)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    shared = PROMPTS[1] + " " + PROMPTS[0] + " and"
    llm = LLM(str(tiny_dirs["llama"]), platform=active.name, registry=conformance.registry, **settings)
    first = llm.generate([shared + " one"], params, use_tqdm=False)[0]
    second = llm.generate([shared + " one", shared + " two"], params, use_tqdm=False)
    ref = LLM(str(tiny_dirs["llama"]), platform=REFERENCE_NAME, registry=conformance.registry,
              enable_prefix_caching=False,
              **settings)
    expected = ref.generate([shared + " one", shared + " two"], params, use_tqdm=False)
    assert second[0].num_cached_tokens > 0, "the repeated prompt did not hit the prefix cache"
    assert second[0].outputs[0].token_ids == first.outputs[0].token_ids
    for got, want in zip(second, expected):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
