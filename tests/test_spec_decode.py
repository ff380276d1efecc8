"""Speculative decoding end to end through `LLM` on the CPU plugin: greedy outputs with
each model-free method equal those without speculation, for a plain model, a sliding
window hybrid, two recurrent hybrids and MLA, batched and one by one, under preemption
(a tight KV pool) and with prefix-cache hits (the same prompts again). Each run must
both accept and reject drafts, so the rollback paths (KV trim, recurrent snapshots) run.
"""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill_conformance.tiny_models import make_tiny_model

# repetitive prompts: drafts from the context are often right, and often wrong
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over",
    "def main():\n    return 42\ndef main():\n    return",
    "Paris is the capital of France; Berlin is the capital of Germany. Paris is",
    "hello",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# per arch: a pool small enough that the four prompts preempt each other (blocks of 4)
TIGHT_BLOCKS = {"llama": 40, "gemma3": 64, "qwen3_next": 100, "bamba": 100, "deepseek_v3": 40}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return lambda arch: make_tiny_model(root / arch, arch)


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", list(TIGHT_BLOCKS))
def test_greedy_identity_per_method(tiny, arch):
    path = str(tiny(arch))
    base = LLM(path, dtype="float32", block_size=4)
    want = _tokens(base.generate(PROMPTS, GREEDY, use_tqdm=False))
    base.engine.shutdown()
    drafted = accepted = 0
    for method in ("ngram", "suffix"):
        # every proposal verified (no adaptivity): the rollback paths run as often as can be
        spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
        llm = LLM(path, dtype="float32", block_size=4, speculative_config=spec)
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want, method
        # again: prefix-cache hits on every prompt
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert _tokens(again) == want, method
        assert llm.engine.kv.stats.hits > 0
        # one by one (batch 1)
        assert [_tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in PROMPTS[:2]] == want[:2]
        stats = llm.engine.spec.drafter.stats
        drafted += stats.num_draft_tokens
        accepted += stats.num_accepted_tokens
        assert llm.engine.kv.usage == 0.0  # every block, lookahead ones included, came back
        llm.engine.shutdown()
        tight = LLM(path, dtype="float32", block_size=4, num_kv_blocks=TIGHT_BLOCKS[arch],
                    max_num_batched_tokens=64, speculative_config=spec)
        assert _tokens(tight.generate(PROMPTS, GREEDY, use_tqdm=False)) == want, method
        assert tight.engine.scheduler.num_preemptions > 0
        assert tight.engine.kv.usage == 0.0
        tight.engine.shutdown()
    # drafts were accepted and rejected (random tiny models rarely repeat an n-gram of
    # their own output; suffix decoding drafts after a single matching token)
    assert 0 < accepted < drafted
