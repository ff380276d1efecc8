"""Grammars compile off the engine's step loop: a sequence whose grammar is not compiled
yet waits outside the scheduler while a background thread compiles it, and the steps of
the running sequences go on meanwhile (llguidance builds without the GIL). Then it runs
under its constraint; an abort while it waits forgets it; a grammar that fails to compile
fails that sequence alone, as an add error."""

from __future__ import annotations

import json
import time

import pytest

from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.frontend.output_processor import ADD_ERROR_STRUCTURED
from tokenmill.frontend.outputs import EngineCoreRequest

SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
         "additionalProperties": False}
# big enough that compiling it takes many engine steps of a tiny model
SLOW = {"anyOf": [{"type": "object", "properties": {f"k{j}_{i}": {"type": "integer"}
                                                   for i in range(20)},
                   "required": [f"k{j}_0"]} for j in range(300)]}


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(str(tiny_dirs["llama"]), dtype="float32", block_size=4, num_kv_blocks=512,
               structured_output_compile_timeout_s=120)


def _request(rid: str, schema: dict | None, max_tokens: int = 40) -> EngineCoreRequest:
    structured = (None if schema is None else
                  StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=schema is None,
                            structured_outputs=structured)
    return EngineCoreRequest(rid, [1, 2, 3, 4], params)


def _run(engine, until_done: set[str], max_steps: int = 2000) -> dict[str, list]:
    deltas: dict[str, list] = {}
    for _ in range(max_steps):
        for d in engine.core_step():
            deltas.setdefault(d.request_id, []).append(d)
        finished = {rid for rid, ds in deltas.items() if ds[-1].finish_reason is not None}
        if until_done <= finished:
            return deltas
    raise AssertionError(f"not finished after {max_steps} steps: {until_done - set(deltas)}")


def test_uncompiled_grammar_waits_outside_the_scheduler_and_then_runs(llm):
    engine = llm.engine
    engine.add_core_request(_request("plain", None, max_tokens=400))
    engine.core_step()
    engine.add_core_request(_request("json", SMALL))
    assert "json" in engine.grammar_waitlist and "json" not in engine.scheduler.requests
    assert engine.has_unfinished_requests()
    deltas = _run(engine, {"json"})
    text = engine.tokenizer.decode([t for d in deltas["json"] for t in d.new_token_ids],
                                   skip_special_tokens=True)
    assert json.loads(text) in ({"ok": True}, {"ok": False})
    assert not engine.grammar_waitlist
    engine.abort_core_requests(["plain"])
    _run(engine, set(), 5)
    assert not engine.has_unfinished_requests()


def test_steps_go_on_while_a_slow_grammar_compiles(llm):
    engine = llm.engine
    engine.add_core_request(_request("runner", None, max_tokens=400))
    engine.core_step()
    t0 = time.perf_counter()
    engine.add_core_request(_request("slow", SLOW, max_tokens=8))
    step_s = []
    while "slow" in engine.grammar_waitlist:
        t = time.perf_counter()
        engine.core_step()
        step_s.append(time.perf_counter() - t)
    waited_s = time.perf_counter() - t0
    # the runner kept stepping while the grammar compiled: no step held the whole compile
    # (were the compile on the step loop, one step would take all of `waited_s`)
    assert len(step_s) >= 3, (waited_s, step_s)
    assert max(step_s) < waited_s / 2, (waited_s, step_s)
    engine.abort_core_requests(["runner", "slow"])
    _run(engine, set(), 5)


def test_abort_while_compiling_forgets_the_sequence(llm):
    engine = llm.engine
    engine.add_core_request(_request("gone", {**SLOW, "title": "aborted"}))
    assert "gone" in engine.grammar_waitlist
    engine.abort_core_requests(["gone"])
    assert not engine.grammar_waitlist and not engine.has_unfinished_requests()


def test_a_grammar_that_fails_to_compile_fails_its_sequence_only(llm):
    engine = llm.engine
    bad = StructuredOutputsParams(grammar="start: ( ")  # lark that does not parse
    engine.add_core_request(EngineCoreRequest("bad", [1, 2], SamplingParams(
        max_tokens=4, structured_outputs=bad)))
    engine.add_core_request(_request("fine", None, max_tokens=4))
    deltas = _run(engine, {"bad", "fine"})
    (error,) = deltas["bad"]
    assert error.finish_reason == "error" and error.add_error == ADD_ERROR_STRUCTURED
    assert deltas["fine"][-1].finish_reason == "length"
