"""Speculative decoding's exact sampling through `LLM` (tiny llama, float32): structured
output and logit_bias masks apply to the drafts (greedy output equals no speculation and
keeps the constraint), and a seeded random request's output is the one it has without
speculation, and survives preemption unchanged (one draw per output token)."""

from __future__ import annotations

import re

from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill_conformance.tiny_models import make_tiny_model

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "hello hello hello"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "adaptive": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_masks_apply_to_drafts_and_seeded_sampling_survives_preemption(tmp_path):
    path = str(make_tiny_model(tmp_path / "llama", "llama"))
    regex = "(ab|ba)+c[a-z ]{3,20}"
    params = [
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                       logit_bias={t: -100.0 for t in range(40, 200)}),
    ]
    base = LLM(path, dtype="float32", block_size=4)
    want = base.generate(PROMPTS, params, use_tqdm=False)
    base.engine.shutdown()
    llm = LLM(path, dtype="float32", block_size=4, speculative_config=SUFFIX)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert re.fullmatch(regex, got[0].outputs[0].text)
    assert not set(got[1].outputs[0].token_ids) & set(range(40, 200))
    stats = llm.engine.spec.drafter.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    llm.engine.shutdown()

    seeded = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=24, ignore_eos=True)
    plain = LLM(path, dtype="float32", block_size=4)
    first = _tokens(plain.generate(PROMPTS * 2, seeded, use_tqdm=False))
    plain.engine.shutdown()
    roomy = LLM(path, dtype="float32", block_size=4, speculative_config=NGRAM)
    assert _tokens(roomy.generate(PROMPTS * 2, seeded, use_tqdm=False)) == first
    assert roomy.engine.spec.drafter.stats.num_drafts > 0
    roomy.engine.shutdown()
    tight = LLM(path, dtype="float32", block_size=4, num_kv_blocks=24, speculative_config=NGRAM)
    assert _tokens(tight.generate(PROMPTS * 2, seeded, use_tqdm=False)) == first
    assert tight.engine.scheduler.num_preemptions > 0
    tight.engine.shutdown()
