"""Data parallel: replicas behind one front. DP=2 x TP=2 (4 worker processes) gives
greedy tokens identical to one process with both replicas used; the router's policy
(prefix affinity, else least loaded, load beyond `max_imbalance` overriding affinity)
checked against a shadow model; an agent session's turns stay on one replica of an
AsyncLLM and hit its prefix cache, while other sessions spread."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineArgs
from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.frontend.dp_router import PrefixAffinityRouter

PROMPTS = ["The quick brown fox", "Paris is the capital of France; Berlin is", "def main():",
           "tokenmill turns any accelerator into tokens"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.long  # four processes
def test_dp2_x_tp2_matches_one_process(tiny_dirs):
    kw = {"dtype": "float32", "block_size": 4, "platform": "cpu", "num_kv_blocks": 64}
    one = LLM(str(tiny_dirs["llama"]), **kw)
    want = _tokens(one)
    one.engine.shutdown()
    llm = LLM(str(tiny_dirs["llama"]), data_parallel_size=2, tensor_parallel_size=2, **kw)
    try:
        engine = llm.engine
        assert [len(e.executor.pids) for e in engine.replicas] == [2, 2]
        assert _tokens(llm) == want
        # four different prompts, no shared prefix: the least loaded replica each time
        assert engine.router.stats.num_routed == 4 and engine.router.stats.num_affinity == 0
        assert [e.scheduler.kv.stats.queries > 0 for e in engine.replicas] == [True, True]
        assert engine.router.loads == [0, 0]
    finally:
        llm.engine.shutdown()


def test_router_affinity_then_least_loaded():
    router = PrefixAffinityRouter(2, block_size=4, max_imbalance=2)
    turn1 = list(range(20))
    assert router.route("a", turn1) == 0  # nobody is loaded: the lowest index
    assert router.route("b", [99] * 20) == 1  # no prefix home: the least loaded
    assert router.route("a2", turn1 + [7, 8]) == 0  # the session's next turn: its home
    assert router.route("salted", turn1, cache_salt="t") == 1  # another tenant's blocks
    assert router.route("short", [1, 2, 3]) == 0  # no full block: the least loaded
    # only the first of 4 blocks in common (a chat template's): not this one's history
    assert router.route("other", list(range(4)) + [50] * 12) == 1
    # replica 0 now runs 3 requests, replica 1 runs 3; a third turn still goes home...
    assert router.route("a3", turn1 + [5]) == 0
    # ...and a fourth, but with replica 0 at 5 and 1 at 3 (imbalance 2), load wins
    assert router.route("a4", turn1 + [6]) == 0
    assert router.route("a5", turn1 + [6]) == 1
    assert router.stats.num_overridden == 1
    with pytest.raises(ValueError, match="already running on replica"):
        router.route("a", turn1)
    for rid in ("a", "b", "a2", "salted", "short", "other", "a3", "a4", "a5"):
        router.finished(rid)
    assert router.loads == [0, 0]


class RouterMachine(RuleBasedStateMachine):
    """Shadow: per request its replica; a prefix's home is where its deepest key last
    went. The router must agree on loads, owners and every placement."""

    @initialize(num=st.integers(1, 3), imbalance=st.integers(1, 3))
    def setup(self, num, imbalance):
        self.router = PrefixAffinityRouter(num, block_size=2, affinity_blocks=2,
                                           max_imbalance=imbalance)
        self.num, self.imbalance = num, imbalance
        self.owners: dict[str, int] = {}
        self.homes: dict[tuple, int] = {}  # prefix (tokens of 1 or 2 blocks) -> replica
        self.next_id = 0

    def _loads(self) -> list[int]:
        return [sum(1 for r in self.owners.values() if r == i) for i in range(self.num)]

    @rule(tokens=st.lists(st.integers(0, 2), min_size=0, max_size=6))
    def route(self, tokens):
        rid = str(self.next_id)
        self.next_id += 1
        loads = self._loads()
        least = min(range(self.num), key=lambda i: (loads[i], i))
        prefixes = [tuple(tokens[: 2 * (k + 1)]) for k in range(min(len(tokens) // 2, 2))]
        depth = next((d for d in range(len(prefixes), 0, -1) if prefixes[d - 1] in self.homes), 0)
        home = self.homes[prefixes[depth - 1]] if 2 * depth >= len(prefixes) and depth else None
        want = home if home is not None and loads[home] - loads[least] < self.imbalance else least
        assert self.router.route(rid, tokens) == want
        self.owners[rid] = want
        for p in prefixes:
            self.homes[p] = want

    @rule(data=st.data())
    def finish(self, data):
        if self.owners:
            rid = data.draw(st.sampled_from(sorted(self.owners)))
            del self.owners[rid]
            self.router.finished(rid)

    @invariant()
    def loads_and_owners_agree(self):
        if hasattr(self, "router"):
            assert self.router.loads == self._loads()
            assert all(self.router.owner(r) == i for r, i in self.owners.items())


TestRouterMachine = RouterMachine.TestCase
TestRouterMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_affinity_keeps_a_session_on_its_replica_and_hits_its_prefix_cache(tiny_dirs):
    args = EngineArgs(model=str(tiny_dirs["llama"]), dtype="float32", block_size=4,
                      platform="cpu", num_kv_blocks=128, data_parallel_size=2)
    llm = AsyncLLM(args)
    engines = llm._client.engines
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def turn(history: list[int], rid: str) -> list[int]:
        final = None
        async for out in llm.generate(history, params, rid):
            final = out
        return history + final.outputs[0].token_ids

    async def sessions():
        tok = llm.tokenizer
        a = tok.encode("Paris is the capital of France; Berlin is the capital of")
        b = tok.encode("def main():\n    return 42 and the quick brown fox")
        a, b = await asyncio.gather(turn(a, "a1"), turn(b, "b1"))
        hits_after_first = [e.kv.stats.hits for e in engines]
        for i in range(2, 4):  # each next turn: the history + a new user message
            a, b = await asyncio.gather(turn(a + tok.encode(" and then"), f"a{i}"),
                                        turn(b + tok.encode(" so"), f"b{i}"))
        return hits_after_first

    llm.start()
    try:
        router = llm._client.router
        hits_before = asyncio.run(sessions())
        # the two sessions went to different replicas (least loaded), and every later
        # turn followed its session: 4 affinity placements, each a prefix-cache hit there
        assert router.stats.num_routed == 6 and router.stats.num_affinity == 4
        hits = [e.kv.stats.hits for e in engines]
        assert hits_before == [0, 0] and min(hits) > 0
        queries = [e.kv.stats.queries for e in engines]
        assert all(h / q > 0.5 for h, q in zip(hits, queries)), (hits, queries)
    finally:
        llm.shutdown()


def test_serve_dp_flag_is_validated(capsys):
    from tokenmill.server.cli import main

    assert main(["serve", "--data-parallel-size", "0", "--port", "1"]) == 2
    assert "data_parallel_size" in capsys.readouterr().err
