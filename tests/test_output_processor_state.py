"""The frontend's half of output processing as a state machine (hypothesis), against a shadow
model: random adds (n sequences, stop strings), per-step deltas from the engine core (also
late ones for sequences the frontend already ended), engine-side finishes and aborts.

Invariants: each sequence's tokens are exactly what its deltas brought until it ended; its
text is the decode of those tokens, cut before the first stop string that completes in it
(finish "stop"); a sequence the frontend ends is reported once in `abort_ids`, never one the
engine ended itself; a parent leaves the processor when all its sequences ended, and its
last output says finished; bookkeeping holds exactly the live parents' sequences.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.frontend.outputs import EngineCoreOutput
from tokenmill.sampling_params import SamplingParams

STOPS = [[], ["e "], ["the", "ow"], ["fox", "a"]]


@pytest.fixture(scope="module")
def tokenizer():
    from tiny_models import make_tokenizer

    return make_tokenizer(256)


def word_tokens(tokenizer) -> list[int]:
    """Ids of tokens that decode alone to plain ASCII letters and spaces, so the text of a
    sequence is the plain decode of its tokens."""
    ids = []
    for tid in range(len(tokenizer)):
        text = tokenizer.decode([tid])
        if text and text.replace(" ", "").isalpha() and text.isascii():
            ids.append(tid)
    return ids


def expected_text(text: str, stop: list[str]) -> tuple[str, str | None]:
    """The text cut before the stop string that completes first (then starts first)."""
    best = None
    for s in stop:
        i = text.find(s)
        if i != -1 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    return (text, None) if best is None else (text[: best[1]], best[2])


class FrontendMachine(RuleBasedStateMachine):
    tokenizer = None
    tokens: list[int] = []

    def __init__(self) -> None:
        super().__init__()
        self.proc = OutputProcessor(self.tokenizer)
        self.num_parents = 0
        # sequence id -> shadow state; parents: parent id -> its sequence ids
        self.seqs: dict[str, dict] = {}
        self.parents: dict[str, list[str]] = {}
        self.engine_live: set[str] = set()  # sequences the engine core still steps

    @rule(n=st.integers(1, 3), stop=st.sampled_from(STOPS), seed=st.one_of(st.none(), st.integers(0, 9)))
    def add(self, n, stop, seed):
        pid = f"p{self.num_parents}"
        self.num_parents += 1
        params = SamplingParams(n=n, stop=stop, seed=seed, max_tokens=None, prompt_logprobs=0)
        core = self.proc.add(pid, None, [1, 2, 3], params)
        assert [c.params.n for c in core] == [1] * n
        assert [c.params.seed for c in core] == [None if seed is None else seed + i for i in range(n)]
        assert [c.params.prompt_logprobs for c in core] == [0] + [None] * (n - 1)
        self.parents[pid] = [c.request_id for c in core]
        for c in core:
            self.seqs[c.request_id] = {"tokens": [], "stop": stop, "done": None, "parent": pid}
            self.engine_live.add(c.request_id)

    @precondition(lambda self: self.engine_live)
    @rule(data=st.data())
    def step(self, data):
        live = sorted(self.engine_live)
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
        deltas = []
        for rid in chosen:
            new = data.draw(st.lists(st.sampled_from(self.tokens), min_size=1, max_size=2))
            finish = data.draw(st.sampled_from([None, None, None, "length", "stop", "error"]))
            deltas.append(EngineCoreOutput(rid, new_token_ids=new, finish_reason=finish))
        done = self.proc.process(deltas)
        ended_by_frontend = []
        for delta in deltas:
            seq = self.seqs[delta.request_id]
            if delta.finish_reason is not None:
                self.engine_live.discard(delta.request_id)
            if seq["done"] is not None:
                continue  # a late delta: ignored
            seq["tokens"] += delta.new_token_ids
            text = self.tokenizer.decode(seq["tokens"])
            cut, found = expected_text(text, seq["stop"])
            if found is not None and delta.finish_reason in (None, "length"):
                seq["done"], seq["text"] = "stop", cut
                if delta.finish_reason is None:
                    ended_by_frontend.append(delta.request_id)
            elif delta.finish_reason is not None:
                seq["done"], seq["text"] = delta.finish_reason, text
        assert sorted(done.abort_ids) == sorted(ended_by_frontend)
        touched = {self.seqs[d.request_id]["parent"] for d in deltas}
        for out in done.outputs:
            assert out.request_id in touched
            for i, rid in enumerate(self.parents[out.request_id]):
                seq, got = self.seqs[rid], out.outputs[i]
                assert got.token_ids == seq["tokens"] and got.finish_reason == seq["done"]
                if seq["done"] is not None:
                    assert got.text == seq["text"]
                else:
                    assert self.tokenizer.decode(seq["tokens"]).startswith(got.text)
            assert out.finished == all(self.seqs[r]["done"] for r in self.parents[out.request_id])
            if out.finished:
                del self.parents[out.request_id]

    @precondition(lambda self: self.parents)
    @rule(data=st.data())
    def abort(self, data):
        pid = data.draw(st.sampled_from(sorted(self.parents)))
        out, ids = self.proc.abort(pid)
        open_ids = [r for r in self.parents[pid] if self.seqs[r]["done"] is None]
        assert ids == open_ids and out.finished
        assert [o.finish_reason for o in out.outputs] == [
            self.seqs[r]["done"] or "abort" for r in self.parents[pid]
        ]
        for rid in open_ids:
            self.seqs[rid]["done"] = "abort"
        del self.parents[pid]

    @rule()
    def engine_applies_aborts(self):
        """The engine core drops the sequences the frontend ended (a step late, or more)."""
        self.engine_live = {r for r in self.engine_live if self.seqs[r]["done"] is None}

    @invariant()
    def bookkeeping(self):
        assert set(self.proc.parents) == set(self.parents)
        assert set(self.proc.child_to_parent) == {r for rids in self.parents.values() for r in rids}


def test_frontend_output_processor_state_machine(tokenizer):
    FrontendMachine.tokenizer = tokenizer
    FrontendMachine.tokens = word_tokens(tokenizer)
    assert len(FrontendMachine.tokens) > 20
    settings(max_examples=60, stateful_step_count=25, deadline=None)(FrontendMachine).TestCase(
        "runTest"
    ).runTest()
