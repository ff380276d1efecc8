"""Structured output (constrained decoding): the mask op against a plain loop, the
parameters' validation, the manager's bounds, and end to end on a tiny random model, whose
outputs obey their constraint only because the mask works."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import pytest
import torch
from tiny_models import make_tokenizer

from tokenmill import LLM, SamplingParams, StructuredOutputError, StructuredOutputsParams
from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.platforms.ops.reference import apply_token_bitmask
from tokenmill.structured.manager import StructuredOutputManager, grammar_for

S = StructuredOutputsParams

# Every value bounded, so even a random model finishes within a few dozen tokens.
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}


# --- the reference op ------------------------------------------------------------------


def loop_mask(logits, bitmask, rows):
    out = logits.clone()
    for k, r in enumerate(rows):
        for t in range(out.shape[1]):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[k, word]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab,words", [(70, 3), (64, 2), (100, 3), (40, 3)])
def test_reference_mask_matches_a_plain_loop(vocab, words):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    bitmask[0, 0] = -1  # all bits set, including the sign bit
    bitmask[1, -1] = 0
    rows = [4, 0, 2]
    expected = loop_mask(logits, bitmask, rows)
    before = bitmask.clone()
    got = logits.clone()
    apply_token_bitmask(got, bitmask, torch.tensor(rows))
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 3]], logits[[1, 3]])  # rows not named are untouched
    assert torch.equal(bitmask, before)


def test_reference_mask_with_no_rows_is_a_no_op():
    logits = torch.randn(2, 40)
    got = logits.clone()
    apply_token_bitmask(got, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(got, logits)


# --- parameters ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex='a', choice"),
        ({"json": {"type": "object"}, "json_object": True}, "got json="),
        ({"choice": []}, "choice"),
        ({"choice": "abc"}, "choice"),
        ({"choice": ["a", 3]}, "choice"),
        ({"json": 5}, "json=5"),
        ({"grammar": ""}, "grammar"),
    ],
)
def test_params_validation_names_the_fields(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        S(**kwargs)


def test_sampling_params_checks_the_type():
    assert SamplingParams(structured_outputs=S(regex="a+")).structured_outputs.kind == "regex"
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a+"})


def test_cache_key_is_canonical():
    a = grammar_for(S(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    b = grammar_for(S(json='{"properties": {"a": {"type": "integer"}},  "type": "object"}'))
    assert a[0] == b[0]
    assert grammar_for(S(json_object=True, disable_any_whitespace=True))[0] != grammar_for(
        S(json_object=True)
    )[0]


# --- the manager's bounds ---------------------------------------------------------------


@pytest.fixture(scope="module")
def manager():
    tok = make_tokenizer(512)
    return StructuredOutputManager(tok, vocab_size=520, eos_token_ids=[tok.eos_token_id])


def masked_ids(manager, request_id):
    step = manager.step_masks([request_id])
    row = step.bitmask[0]
    return [t for t in range(manager.vocab_size) if (int(row[t // 32]) >> (t % 32)) & 1]


@pytest.mark.parametrize(
    "params,match",
    [
        (S(json='{"type": "foo"}'), "Invalid type"),
        (S(json="{not json"), "not valid JSON"),
        (S(json="[1, 2]"), "must be an object"),
        (S(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "nope"),
        (S(regex="(["), "unclosed character class"),
        (S(grammar="start: foo"), "foo"),
    ],
)
def test_invalid_constraints_raise_structured_output_error(manager, params, match):
    with pytest.raises(StructuredOutputError, match=match):
        manager.compile(params)
    with pytest.raises(StructuredOutputError, match=match):  # cached as invalid: same error
        manager.compile(params)


def test_cache_is_bounded_and_lru():
    tok = make_tokenizer(512)
    m = StructuredOutputManager(tok, vocab_size=512, eos_token_ids=[2], cache_size=3)
    first = m.compile(S(regex="a0"))
    for i in range(1, 6):
        m.compile(S(regex=f"a{i}"))
        assert m.num_cached == min(i + 1, 3)
        assert m.compile(S(regex="a0")) is first  # kept: used most recently
    assert m.compile(S(regex="a1")) is not None and m.num_cached == 3


def test_compile_time_is_bounded():
    tok = make_tokenizer(512)
    m = StructuredOutputManager(tok, vocab_size=512, eos_token_ids=[2], compile_timeout_s=0.002)
    _ = m.tokenizer  # built outside the bound
    # about 0.1 s to compile on one core, 50x the bound
    regex = "|".join(f"w{i}x{i * 7919}" for i in range(20_000))
    with pytest.raises(StructuredOutputError, match="took longer than 0.002 s"):
        m.compile(S(regex=regex))
    assert m.num_cached == 0  # a timeout is not cached as an error: it may be load


def test_a_slow_build_runs_once_and_caches_its_outcome():
    tok = make_tokenizer(512)
    m = StructuredOutputManager(tok, vocab_size=512, eos_token_ids=[2], compile_timeout_s=0.002)
    _ = m.tokenizer
    params = S(regex="|".join(f"w{i}y{i * 7919}" for i in range(20_000)))
    for _ in range(3):  # the client retries while the first build still runs
        with pytest.raises(StructuredOutputError, match="took longer"):
            m.compile(params)
    assert m.num_building == 1  # one build, joined by the retries
    deadline = time.monotonic() + 60
    while m.num_building and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m.num_cached == 1 and not m.num_building
    assert m.compile(params) is not None  # the late outcome serves the next repeat


def test_pathological_regexes_are_bounded(manager):
    start = time.monotonic()
    # backtracking engines take exponential time on (a|aa)*b against a run of a's
    matcher = manager.compile(S(regex="(a|aa)*b"))
    manager.add_request("patho", matcher)
    a = manager.hf_tokenizer.encode("a")[0]
    for _ in range(200):
        assert a in masked_ids(manager, "patho")
        assert manager.accept("patho", a) is None
    manager.remove_request("patho")
    huge = "|".join(f"w{i}x{i * 7919}" for i in range(100_000))
    try:
        manager.compile(S(regex=huge))
    except StructuredOutputError as e:
        assert "too big" in str(e) or "longer than" in str(e)
    assert time.monotonic() - start < 30


def test_mask_allows_only_eos_when_the_constraint_is_complete(manager):
    tok = manager.hf_tokenizer
    manager.add_request("done", manager.compile(S(choice=["a"])))
    assert masked_ids(manager, "done") == tok.encode("a")
    assert manager.accept("done", tok.encode("a")[0]) is None
    assert manager.is_ended("done")
    assert masked_ids(manager, "done") == [tok.eos_token_id]
    step = manager.step_masks(["other", "done"])
    assert step.row_indices == [1] and step.ended_rows == [1]
    assert manager.accept("done", 7) is not None  # breaks the constraint: an error, no raise
    manager.remove_request("done")
    assert manager.step_masks(["done"]) is None


# --- end to end on a tiny random model ---------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(str(tiny_dirs["llama"]), dtype="float32", block_size=4)


PROMPTS = ["The quick brown fox", "def main():", "Paris is the capital of", "héllo wörld"]
SAMPLERS = {
    "greedy": dict(temperature=0),
    "seeded": dict(temperature=1.0, seed=11),
    "random": dict(temperature=1.3, top_p=0.95),
}


def text_of(out):
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    return out.text


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_choice_regex_and_schema_hold_on_a_random_model(llm, sampler):
    choices = ["yes", "no", "maybe later"]
    regex = r"[0-9]{3}-[a-c]{2,5}"
    kw = SAMPLERS[sampler]
    params = [
        SamplingParams(max_tokens=40, n=2, structured_outputs=S(choice=choices), **kw),
        SamplingParams(max_tokens=40, structured_outputs=S(regex=regex), **kw),
        SamplingParams(max_tokens=60, structured_outputs=S(json=SMALL_SCHEMA,
                                                           disable_any_whitespace=True), **kw),
        SamplingParams(max_tokens=40, structured_outputs=S(grammar='start: "(" NUM ")"\nNUM: /[0-9]{1,4}/'), **kw),
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(outs[0].outputs) == 2
    for o in outs[0].outputs:
        assert text_of(o) in choices
    assert re.fullmatch(regex, text_of(outs[1].outputs[0]))
    jsonschema.validate(json.loads(text_of(outs[2].outputs[0])), SMALL_SCHEMA)
    assert re.fullmatch(r"\([0-9]{1,4}\)", text_of(outs[3].outputs[0]))
    # the finishing token is one of the request's EOS ids
    eos = llm.engine.loaded.eos_token_ids
    assert all(o.outputs[0].token_ids[-1] in eos for o in outs)
    assert llm.engine.structured.num_requests == 0  # matchers freed


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(llm):
    plain = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)]
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=40,
                                 structured_outputs=S(regex="[a-z]{5,20}"))
    mixed = llm.generate(PROMPTS, plain + [constrained] * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert all(re.fullmatch("[a-z]{5,20}", text_of(o.outputs[0])) for o in mixed[2:])


def test_seeded_constrained_output_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                            structured_outputs=S(json=SMALL_SCHEMA, disable_any_whitespace=True))
    alone = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    batched = llm.generate(PROMPTS, [params] + [SamplingParams(temperature=1.0, max_tokens=8)] * 3,
                           use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == batched.token_ids


def test_chunked_prefill_and_preemption_keep_the_constraint(tiny_dirs):
    tight = LLM(str(tiny_dirs["llama"]), dtype="float32", block_size=4, num_kv_blocks=32,
                max_model_len=128, max_num_batched_tokens=8)
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=60,
                            structured_outputs=S(json=SMALL_SCHEMA, disable_any_whitespace=True))
    outs = tight.generate(PROMPTS * 2, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(text_of(out.outputs[0])), SMALL_SCHEMA)


def test_sampling_features_work_with_the_mask(llm):
    eos = llm.engine.loaded.eos_token_ids
    # every token of the only choice is forced: logprobs are of the masked distribution
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.7, max_tokens=20, logprobs=2,
                                                  structured_outputs=S(choice=["hello world"])),
                       use_tqdm=False)[0].outputs[0]
    assert text_of(out) == "hello world"
    assert all(lp[t].logprob == 0.0 for lp, t in zip(out.logprobs, out.token_ids))
    # a complete constraint wins over min_tokens and ignore_eos: EOS, finish "stop"
    for extra in (dict(min_tokens=10), dict(ignore_eos=True)):
        out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30,
                                                      structured_outputs=S(choice=["ab"]), **extra),
                           use_tqdm=False)[0].outputs[0]
        assert text_of(out) == "ab" and out.token_ids[-1] in eos
    # min_tokens still holds while the constraint allows more: a+ with at least 6 tokens
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, min_tokens=6,
                                                  structured_outputs=S(regex="(ab)+")),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("(ab)+", text_of(out)) and len(out.token_ids) >= 7
    # penalties, top_k/min_p and stop strings
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=1.0, seed=4, max_tokens=40,
                                                  repetition_penalty=1.8, presence_penalty=1.0,
                                                  top_k=5, min_p=0.01,
                                                  structured_outputs=S(regex="[a-d]{4,12}")),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[a-d]{4,12}", text_of(out))
    # max_tokens first: "length" with a prefix of a valid output
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=3,
                                                  structured_outputs=S(regex="x{10}")),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.text == "x" * len(out.text)


def test_invalid_constraint_fails_alone_and_the_engine_keeps_serving(llm):
    engine = llm.engine
    good = SamplingParams(temperature=0, max_tokens=20, structured_outputs=S(choice=["yes", "no"]))
    ids = engine.tokenizer.encode(PROMPTS[0])
    engine.add_request("good-1", ids, good)
    with pytest.raises(StructuredOutputError, match="Invalid type"):
        engine.add_request("bad", ids, SamplingParams(structured_outputs=S(json={"type": "nope"})))
    engine.add_request("good-2", ids, SamplingParams(temperature=0, max_tokens=5))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["good-1", "good-2"]
    assert finished["good-1"].outputs[0].text in ("yes", "no")
    with pytest.raises(StructuredOutputError):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=S(regex="(")), use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_async_generate_raises_before_any_output_and_keeps_serving(llm):
    engine = AsyncLLM(engine=llm.engine)
    engine.start()
    ids = llm.engine.tokenizer.encode(PROMPTS[0])
    good = SamplingParams(temperature=0, max_tokens=20, structured_outputs=S(choice=["yes", "no"]))

    async def main():
        gen = engine.generate(ids, SamplingParams(structured_outputs=S(grammar="start: undefined_rule")), "bad")
        with pytest.raises(StructuredOutputError):
            await anext(gen)
        outs = [o async for o in engine.generate(ids, good, "good")]
        return outs[-1]

    try:
        last = asyncio.run(main())
    finally:
        engine.shutdown()
    assert last.finished and last.outputs[0].text in ("yes", "no")
    assert not engine.error or "shut down" in str(engine.error)


def test_no_per_step_work_without_constraints(tiny_dirs, monkeypatch):
    fresh = LLM(str(tiny_dirs["llama"]), dtype="float32", block_size=4)

    def boom(*args, **kwargs):
        raise AssertionError("step_masks called without a constrained request")

    monkeypatch.setattr(fresh.engine.structured, "step_masks", boom)
    fresh.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert fresh.engine.structured._tokenizer is None  # nothing was even built
