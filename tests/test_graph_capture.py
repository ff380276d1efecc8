"""Decode steps through `tokenmill_graph_capture`: the core runner pads decode batches to
a captured bucket and replays; greedy and seeded outputs equal the eager run's, and the
replays really happened (counted by the test platform, tests/graph_plugin.py)."""

from __future__ import annotations

import pytest
from graph_plugin import GraphsPlugin, ReplayingGraphs, hookimpl

from tokenmill import LLM, SamplingParams
from tokenmill.platforms.registry import PlatformError, PlatformRegistry
from tokenmill_cpu import plugin as cpu

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "def main():",
    "héllo wörld, naïve café, 你好世界 🙂 and then some more words",
    "one two three",
]


def _registry(graphs_plugin: GraphsPlugin) -> PlatformRegistry:
    registry = PlatformRegistry()
    registry.register_plugin(cpu, "cpu")
    registry.register_plugin(graphs_plugin, "cpu-graphs")
    return registry


def _params():
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    return [greedy, seeded, greedy, seeded, greedy]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graph_replay_gives_the_eager_tokens(tiny_dirs, arch):
    plugin = GraphsPlugin()
    registry = _registry(plugin)
    kw = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 128, "max_num_seqs": 8}
    eager = LLM(str(tiny_dirs[arch]), platform="cpu", registry=registry, **kw)
    graphed = LLM(str(tiny_dirs[arch]), platform="cpu-graphs", registry=registry, **kw)
    # 5 requests decode in bucket 8 (3 padding rows); 1 alone in bucket 1
    for prompts in (PROMPTS, PROMPTS[:1]):
        params = _params()[: len(prompts)]
        want = eager.generate(prompts, params, use_tqdm=False)
        got = graphed.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    (graphs,) = plugin.graphs
    assert sorted(graphs.captured) == [1, 2, 4, 8]
    assert graphs.replays[8] >= 10 and graphs.replays[1] >= 10, graphs.replays
    runner = graphed.engine.executor.worker.runner
    assert runner.decode_graphs.num_replays == sum(graphs.replays.values())
    assert eager.engine.executor.worker.runner.decode_graphs is None


def test_batches_larger_than_every_bucket_run_eagerly(tiny_dirs):
    plugin = GraphsPlugin()
    registry = _registry(plugin)
    kw = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 128, "max_num_seqs": 8}
    kw["max_num_seqs"] = 16  # buckets stay 1, 2, 4, 8: a decode batch of 10 runs eagerly
    llm = LLM(str(tiny_dirs["llama"]), platform="cpu-graphs", registry=registry, **kw)
    eager = LLM(str(tiny_dirs["llama"]), platform="cpu", registry=registry, **kw)
    prompts, params = PROMPTS * 2, _params() * 2
    want = eager.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert not plugin.graphs[0].replays  # every decode step had 10 requests


class _BadBuckets(ReplayingGraphs):
    def batch_sizes(self, max_num_seqs):
        return [4, 2]


class _BadBucketsPlugin(GraphsPlugin):
    @hookimpl
    def tokenmill_graph_capture(self, platform):
        return _BadBuckets()


def test_registry_refuses_unordered_buckets():
    plugin = _BadBucketsPlugin()
    registry = PlatformRegistry()
    registry.register_plugin(plugin, "cpu-graphs")
    active = registry.load_platform("cpu-graphs")
    with pytest.raises(PlatformError, match=r"batch_sizes\(8\) returned \[4, 2\]"):
        active.graph_capture(8)
