"""T3 end to end: greedy outputs on the plugin equal the reference platform's, token for
token, on a tiny random model of every architecture the core supports; with chunked
prefill mixed into decodes and with prefix caching."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams
from tokenmill_conformance.session import REFERENCE_NAME
from tokenmill_conformance.suite.t3.common import (
    ARCHS,
    PROMPTS,
    UNCOVERED,
    assert_plugin_backends,
    compare,
    engine_settings,
    greedy_tokens,
)


def test_every_supported_architecture_has_a_tiny_model():
    assert not UNCOVERED, f"the core supports model types {UNCOVERED}; the suite has no tiny model"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_reference(conformance, active, tiny_dirs, reference_tokens, arch):
    settings = engine_settings(active)
    expected = reference_tokens(arch)
    got, llm = greedy_tokens(conformance, tiny_dirs[arch], active.name, keep=True, **settings)
    compare(got, expected)
    if llm.engine.executor.worker.runner_provider != active.name:  # the core's runner
        assert_plugin_backends(llm, active)  # the plugin's own runner: test_runner_paths.py


@pytest.mark.parametrize("arch", ["qwen3"])
def test_chunked_prefill_mixed_with_decodes(
    conformance, active, tiny_dirs, reference_tokens, arch
):
    settings = engine_settings(active)
    expected = reference_tokens(arch)
    got = greedy_tokens(
        conformance, tiny_dirs[arch], active.name,
        max_num_batched_tokens=8, max_num_seqs=3, **settings,
    )
    compare(got, expected)


def test_prefix_cache_hits_give_the_same_tokens(conformance, active, tiny_dirs):
    from tokenmill import LLM

    settings = engine_settings(active)
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
