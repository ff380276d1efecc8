"""The runner seam is symmetric: the worker asks what a runner declares, never which runner
it is. A plugin's runner is built through the same hook as the core's, gets the worker's
KV pages, and is refused at start, naming what it lacks, when the model or the engine's
settings need a capability it does not declare (a layer kind, KV offload, sleep mode)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pluggy
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.platforms.interfaces import (
    AttentionKind,
    KVCacheLayout,
    ModelRunnerBase,
    RunnerCapabilities,
)
from tokenmill.platforms.registry import PlatformRegistry
from tokenmill_conformance import reference_platform

hookimpl = pluggy.HookimplMarker("tokenmill")
_spec = importlib.util.spec_from_file_location(
    "_tokenmill_seam_runner_plugin", Path(__file__).parent / "conformance" / "runner_plugin.py"
)
runner_plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner_plugin)


class FullOnly(runner_plugin.TransformersRunner):
    """The transformers runner, declaring full attention only."""

    def capabilities(self) -> RunnerCapabilities:
        return RunnerCapabilities(attention_kinds=frozenset({AttentionKind.FULL}))


class Plugin:
    """The reference platform with a runner of its own for every model."""

    def __init__(self, runner_cls: type[ModelRunnerBase]) -> None:
        self.runner_cls = runner_cls

    @hookimpl
    def tokenmill_api_version(self):
        return "1.6"

    @hookimpl
    def tokenmill_detect(self):
        return reference_platform.tokenmill_detect()

    @hookimpl
    def tokenmill_platform(self):
        return reference_platform.tokenmill_platform()

    @hookimpl
    def tokenmill_attention_backends(self, platform):
        return reference_platform.tokenmill_attention_backends(platform)

    @hookimpl
    def tokenmill_allocator(self, platform, purpose):
        return reference_platform.tokenmill_allocator(platform, purpose)

    @hookimpl
    def tokenmill_hardware_spec(self, platform):
        return reference_platform.tokenmill_hardware_spec(platform)

    @hookimpl
    def tokenmill_model_runner(self, platform, context):
        return self.runner_cls(context)


def _llm(path, runner_cls, **kw) -> LLM:
    registry = PlatformRegistry()
    registry.register_plugin(Plugin(runner_cls), "seam")
    return LLM(str(path), platform="seam", registry=registry, dtype="float32", block_size=4,
               num_kv_blocks=64, **kw)


def test_a_plugin_runner_gets_the_worker_s_pages_and_runs(tiny_dirs):
    llm = _llm(tiny_dirs["llama"], runner_plugin.TransformersRunner)
    worker = llm.engine.executor.worker
    assert worker.runner_provider == "seam" and worker.arena is not None
    assert worker.runner.num_blocks == llm.engine.num_kv_blocks  # bound to the arena's pages
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_layer_kind_the_runner_does_not_declare_is_refused(tmp_path):
    from tokenmill_conformance.tiny_models import make_tiny_model

    bamba = make_tiny_model(tmp_path / "bamba", "bamba")
    with pytest.raises(ValueError, match=r"model type 'bamba' has \['linear'\] layers, which "
                                         r"FullOnly \(from plugin 'seam'\) does not run"):
        _llm(bamba, FullOnly)


def test_kv_offload_needs_a_runner_that_declares_it(tiny_dirs):
    with pytest.raises(ValueError, match="KV offload is configured but TransformersRunner "
                                         r"\(from plugin 'seam'\) declares no kv_offload"):
        _llm(tiny_dirs["llama"], runner_plugin.TransformersRunner,
             kv_offload_host_bytes="1MiB")


def test_sleep_needs_a_runner_that_declares_it(tiny_dirs):
    llm = _llm(tiny_dirs["llama"], runner_plugin.TransformersRunner)
    with pytest.raises(RuntimeError, match="declares no sleep mode"):
        llm.sleep(level=1)


def test_the_layout_a_runner_asks_for_sizes_the_pool(tiny_dirs):
    """The worker computes the block size from the runner's KVCacheLayout (no
    kv_block_bytes of the runner's own)."""
    llm = _llm(tiny_dirs["llama"], runner_plugin.TransformersRunner)
    worker = llm.engine.executor.worker
    layout = worker.runner.kv_cache_layout()
    assert isinstance(layout, KVCacheLayout)
    page = worker.arena.page_bytes
    assert worker.kv_block_bytes() == page * len(layout.attention_specs)
