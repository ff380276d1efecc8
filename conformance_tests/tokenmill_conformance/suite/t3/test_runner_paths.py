"""T3 through the plugin's own execution paths: a model runner of its own
(`tokenmill_model_runner`) and decode-step graphs (`tokenmill_graph_capture`). The greedy
comparisons of test_greedy.py already run through whatever the engine picked; these tests
check that the engine really picked the plugin's path, and compare again where only that
path is exercised (decode batches padded to graph buckets)."""

from __future__ import annotations

import pytest

from tokenmill_conformance.suite.t3.common import (
    ARCHS,
    PROMPTS,
    compare,
    engine_settings,
)


def _worker(llm):
    return llm.engine.executor.worker


def _runs_own_runner(llm, active) -> bool:
    """Whether the plugin's `tokenmill_model_runner` built the runner (else the core's)."""
    return _worker(llm).runner_provider == active.name


def test_own_model_runner_serves_the_models(conformance, active, tiny_dirs, reference_tokens):
    """When the plugin implements tokenmill_model_runner, its runner must run at least one
    tiny model (it may decline the others with None) and match the reference on each."""
    from tokenmill import LLM, SamplingParams

    if not hasattr(conformance.plugin, "tokenmill_model_runner"):
        pytest.skip("the plugin brings no model runner of its own; the core's runs its steps")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    served = []
    for arch in ARCHS:
        llm = LLM(str(tiny_dirs[arch]), platform=active.name, registry=conformance.registry,
                  **engine_settings(active))
        if not _runs_own_runner(llm, active):
            continue  # declined this model: the core's runner ran it in test_greedy
        served.append(arch)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        compare(got, reference_tokens(arch))
    assert served, (
        "tokenmill_model_runner is implemented but returned None for every tiny model "
        f"({ARCHS}); T3 cannot check the plugin's runner"
    )


def test_decode_graphs_replay_and_match(conformance, active, tiny_dirs, reference_tokens):
    """With capabilities.graphs, decode steps replay captured graphs (batches padded to the
    plugin's buckets) and the tokens equal the reference platform's."""
    from tokenmill import LLM, SamplingParams

    if not active.platform.capabilities.graphs:
        pytest.skip("the platform does not declare capabilities.graphs")
    llm = LLM(str(tiny_dirs["llama"]), platform=active.name, registry=conformance.registry,
              max_num_seqs=len(PROMPTS), **engine_settings(active))
    runner = _worker(llm).runner
    if _runs_own_runner(llm, active):
        pytest.skip("the plugin's own model runner runs the steps; graphs are its business")
    assert runner.decode_graphs is not None, (
        "capabilities.graphs is declared but tokenmill_graph_capture returned None"
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    compare(got, reference_tokens("llama"))
    assert runner.decode_graphs.num_replays > 0, "no decode step replayed a captured graph"
