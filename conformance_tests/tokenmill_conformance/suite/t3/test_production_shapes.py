"""T3 at production attention shapes: a tiny Qwen3 with head size 128 and 8 query heads
over 2 KV heads (GQA 4), at two declared block sizes (the smallest and the largest), in a
KV pool small enough that requests are preempted and recomputed, then the same prompts
again so they hit the prefix cache. Greedy tokens must equal the reference platform's
(prefix caching off, a pool that never preempts), preemptions and prefix hits must have
happened, and every attention layer must have run on one of the plugin's own backends: a
layer that fell back to the core's reference fails the test (a plugin's own model runner
runs every layer itself: test_runner_paths.py checks that it ran)."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams
from tokenmill_conformance.session import REFERENCE_NAME
from tokenmill_conformance.suite.conftest import capabilities_of
from tokenmill_conformance.suite.t3.common import (
    PROMPTS,
    assert_plugin_backends,
    compare,
    engine_settings,
)
from tokenmill_conformance.tiny_models import CORPUS, PRODUCTION_VARIANTS, make_tiny_model

# the prompts span at least this many tokens (and two blocks), so the smallest blocks too
# leave a prefix of several blocks for the second pass to find in the prefix cache
MIN_PROMPT_TOKENS = 48
# tokens generated per request: the prompts end one token short of a block boundary, so
# each request takes one more block within these (a pool with one spare block preempts)
DECODE_TOKENS = 4


def _prompts(tokenizer, block_size: int) -> list[dict]:
    """Token-id prompts of `blocks * block_size - 1` tokens: whole blocks the second pass
    finds in the prefix cache, then one token short of the next block. Distinct from their
    first token: no request shares another's blocks, so the pool size below is exact."""
    blocks = max(2, -(-MIN_PROMPT_TOKENS // block_size))
    length = blocks * block_size - 1
    corpus = " ".join(CORPUS)
    prompts = []
    for prompt in PROMPTS:
        text = f"{prompt} {corpus}"
        while len(ids := tokenizer(text)["input_ids"]) < length:
            text = f"{text} {corpus}"
        prompts.append({"prompt_token_ids": ids[:length]})
    return prompts


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "block_size" in metafunc.fixturenames:
        caps = capabilities_of(metafunc.config)
        sizes = [] if caps is None else sorted({min(caps.block_sizes), max(caps.block_sizes)})
        metafunc.parametrize("block_size", sizes, ids=[f"block{b}" for b in sizes])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    (arch,) = PRODUCTION_VARIANTS
    return make_tiny_model(tmp_path_factory.mktemp("production") / arch, arch)


def _pool_blocks(prompts: list[dict], block_size: int) -> int:
    """A pool that admits every prompt and one more block: as the requests decode past a
    block boundary all but one are preempted."""
    return sum(-(-len(p["prompt_token_ids"]) // block_size) for p in prompts) + 1


def test_head128_gqa_preemption_and_prefix_hits(conformance, active, model_dir, block_size):
    from tokenmill import LLM

    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    settings = {**engine_settings(active), "block_size": block_size}
    reference = LLM(str(model_dir), platform=REFERENCE_NAME, registry=conformance.registry,
                    enable_prefix_caching=False, **settings)
    prompts = _prompts(reference.get_tokenizer(), block_size)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params,
                                                                   use_tqdm=False)]
    settings["num_kv_blocks"] = _pool_blocks(prompts, block_size)
    llm = LLM(str(model_dir), platform=active.name, registry=conformance.registry,
              max_num_seqs=len(prompts), **settings)
    for attempt in ("first pass (preempting)", "second pass (prefix hits)"):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        try:
            compare(got, expected)
        except AssertionError as exc:
            raise AssertionError(f"{attempt}, block size {block_size}: {exc}") from None
    stats = llm.engine.scheduler_stats()
    assert stats.num_preemptions > 0, (
        f"no request was preempted in a pool of {settings['num_kv_blocks']} blocks")
    assert stats.prefix_cache_hits > 0, (
        f"the second pass did not hit the prefix cache (block size {block_size}, "
        f"{stats.prefix_cache_queries} tokens looked up)")
    if llm.engine.executor.worker.runner_provider != active.name:  # the core's runner
        assert_plugin_backends(llm, active, strict=True)
    # else the plugin's own runner (tokenmill_model_runner) ran every layer, with no core
    # backend to fall back to; test_runner_paths.py certifies that it serves the models
