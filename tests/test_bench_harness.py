"""Fast checks of the serving benchmark's pure parts: percentiles, goodput, trace scaling."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

# the peer benchmark's own modules (capacity, reuse, report) are scripts beside run.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "serving"))

from tokenmill.server.bench import workloads as wl  # noqa: E402
from tokenmill.server.bench.stats import RequestResult, Slo, percentile, summarize  # noqa: E402

WORDS = wl.Words([f"w{i}" for i in range(500)])


@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    rng = np.random.default_rng(q)
    xs = rng.exponential(size=37).tolist()
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], q))


def test_goodput_counts_only_requests_within_the_slo():
    fast = RequestResult("a", 0, 0.0, ok=True, ttft=0.1, e2e=1.1, output_tokens=11)  # tpot 0.1
    slow = RequestResult("b", 0, 0.0, ok=True, ttft=3.0, e2e=4.0, output_tokens=11)
    failed = RequestResult("c", 0, 0.0, error="cancelled", output_tokens=5)
    s = summarize([fast, slow, failed], 2.0, Slo(ttft=2.0, tpot=0.1))
    assert s["failed"] == 1 and s["req_per_s"] == 1.0 and s["goodput_req_per_s"] == 0.5
    assert s["output_tok_per_s"] == (11 + 11 + 5) / 2.0  # streamed tokens of cancelled requests count
    assert s["ttft_p50_ms"] == pytest.approx(1550.0)


def _write_trace(tmp_path: Path) -> Path:
    trace = {"id": "t1", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 256, "out": 64, "hash_ids": [1, 2, 3, 4], "think_time": 0.0},
        {"t": 32.0, "type": "n", "in": 380, "out": 32, "hash_ids": [1, 2, 3, 4, 5, 6], "think_time": 16.0},
        {"t": 40.0, "type": "s", "in": 128, "out": 10, "hash_ids": [1, 9], "think_time": 0.0},
        {"t": 50.0, "type": "n", "in": 64000, "out": 10, "hash_ids": list(range(1000)), "think_time": 1.0},
    ]}
    (tmp_path / "t1.json").write_text(json.dumps(trace))
    return tmp_path


def test_claude_code_scaling_keeps_the_sharing_structure(tmp_path):
    (s,) = wl.claude_code(WORDS, _write_trace(tmp_path), factor=32, time_factor=16, max_sessions=5,
                          max_model_len=1024, stagger_s=0.0)
    first, second, sub = s.turns  # the 64k-token request passes max_model_len and is dropped
    a, b, c = (t.prompt.split() for t in (first, second, sub))
    assert (len(a), len(b), len(c)) == (8, 12, 4) == tuple(t.expected_prompt_tokens for t in s.turns)
    assert b[:8] == a  # hash ids 1-4 shared: 4 blocks of 64/32 = 2 words
    assert c[:2] == a[:2] and c[2:] != a[2:4]  # shares block 1 only
    assert (first.max_tokens, second.max_tokens) == (2, 1)
    assert (second.pause_s, second.at_s, second.stream, sub.stream) == (1.0, 2.0, "main", "sub")


def test_mooncake_scaling(tmp_path):
    lines = [{"timestamp": 0, "input_length": 1024, "output_length": 128, "hash_ids": [0, 1]},
             {"timestamp": 2000, "input_length": 1500, "output_length": 64, "hash_ids": [0, 1, 2]}]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    a, b = wl.mooncake(WORDS, path, factor=64, time_factor=2.0, max_requests=10, max_model_len=8192)
    pa, pb = a.turns[0].prompt.split(), b.turns[0].prompt.split()
    assert (len(pa), len(pb)) == (16, 23) and pb[:16] == pa
    assert (a.turns[0].max_tokens, b.start_s) == (2, 1.0)


def test_a_turn_due_after_the_time_limit_is_skipped_not_waited_for(monkeypatch):
    import asyncio

    from tokenmill.server.bench import loadgen
    from tokenmill.server.bench.loadgen import Session, Target, Turn

    async def fake_send(client, target, turn, messages, res, t0):
        res.ttft, res.e2e, res.ok = 0.01, 0.01, True

    monkeypatch.setattr(loadgen, "_send", fake_send)
    s = Session("a", [Turn(1, prompt="x", at_s=0.0), Turn(1, prompt="y", at_s=3.0),  # due late
                      Turn(1, prompt="z", stream="sub"),
                      Turn(1, prompt="q", pause_s=3.0, stream="sub")])  # its pause ends late
    late = Session("b", [Turn(1, prompt="w")], start_s=3.0)
    results, duration = asyncio.run(loadgen.run_workload(Target("http://127.0.0.1:9", "m"),
                                                         [s, late], None, time_limit_s=0.2))
    assert [(r.session, r.turn) for r in results] == [("a", 0), ("a", 2)] and duration < 1.0


def _trace(tid: str, times: list[float], hash_ids: list[list[int]]) -> dict:
    return {"id": tid, "block_size": 64, "requests": [
        {"t": t, "type": "n", "in": 64 * len(h), "out": 64, "hash_ids": h, "think_time": 0.0}
        for t, h in zip(times, hash_ids)]}


def test_claude_code_slots_play_sessions_back_to_back_without_sharing(tmp_path):
    # three 2-turn sessions, each lasting 32 s of trace time = 1 s scaled
    for i in range(3):
        (tmp_path / f"s{i}.json").write_text(json.dumps(_trace(f"s{i}", [0.0, 32.0], [[1], [1, 2]])))
    sessions = wl.claude_code_slots(WORDS, tmp_path, factor=32, time_factor=32, num_slots=2,
                                    window_s=2.5, ramp_s=1.0, max_model_len=1024)
    # slot 0 plays traces 0, 2, 1 (index 4 -> lap 1) to cover 2.5 s: 3 x 1 s;
    # slot 1 starts at 0.5 s and plays 1, 0 (index 3 -> lap 1): 0.5 + 2 x 1 s
    assert [(s.slot, s.name) for s in sessions] == [
        (0, "s0/0"), (0, "s2/0"), (0, "s1/1"), (1, "s1/0"), (1, "s0/1")]
    # the first session of slot 1 starts at 1 * ramp / 2; later ones count from their start
    assert [s.start_s for s in sessions] == [0.0, 0.0, 0.0, 0.5, 0.0]
    assert [t.at_s for t in sessions[3].turns] == [0.5, 1.5]
    # the same trace on another lap shares no words; within a session, turns share the prefix
    s0, s0_again = sessions[0], sessions[4]
    assert s0.turns[1].prompt.startswith(s0.turns[0].prompt)
    assert s0.turns[0].prompt != s0_again.turns[0].prompt
    assert len(s0.turns[0].prompt.split()) == len(s0_again.turns[0].prompt.split()) == 2


def test_slotted_sessions_run_one_after_another(monkeypatch):
    import asyncio
    import time

    from tokenmill.server.bench import loadgen
    from tokenmill.server.bench.loadgen import Session, Target, Turn

    async def fake_send(client, target, turn, messages, res, t0):
        res.start = time.perf_counter() - t0
        await asyncio.sleep(0.05)
        res.ttft, res.e2e, res.ok = 0.05, 0.05, True

    monkeypatch.setattr(loadgen, "_send", fake_send)
    a = Session("a", [Turn(1, prompt="x", at_s=0.0), Turn(1, prompt="y", at_s=0.1)], slot=0)
    b = Session("b", [Turn(1, prompt="z", at_s=0.1)], slot=0)
    free = Session("c", [Turn(1, prompt="w", at_s=0.0)])
    results, _ = asyncio.run(loadgen.run_workload(Target("http://127.0.0.1:9", "m"), [a, b, free],
                                                  None, time_limit_s=10))
    start = {(r.session, r.turn): r.start for r in results}
    assert len(results) == len(start) == 4  # every turn sent once
    assert start[("a", 1)] >= 0.1
    # b starts when a has ended (>= 0.15 s), and its at_s of 0.1 counts from there
    assert start[("b", 0)] >= start[("a", 1)] + 0.05 + 0.1
    assert start[("c", 0)] < start[("b", 0)] - 0.2  # a session without a slot waits for none


def _req(session, turn, start, ttft, prompt_tokens=0, cached=None, ok=True, sent=0, seen=0):
    return {"session": session, "turn": turn, "start": start, "ttft": ttft, "ok": ok,
            "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "expected_prompt_tokens": sent, "seen_prefix_words": seen}


def test_seen_prefix_counts_only_earlier_prefilled_prompts_of_the_session():
    from reuse import seen_prefix_words

    prompts = {("s", 0): " a b c d", ("s", 1): " a b c d e f", ("s", 2): " a b x",
               ("s", 3): " a b c d e f g", ("t", 0): " a b c d e f g"}
    reqs = [_req("s", 0, 0.0, 1.0),    # first token at 1.0
            _req("s", 1, 2.0, 0.5),    # sent after s0's first token: shares 4 words
            _req("s", 2, 0.5, 0.1),    # sent before s0's first token: nothing seen yet
            _req("s", 3, 2.4, 0.1),    # s1 (2.5) not yet prefilled: best is s0 (4), s2 (2)
            _req("t", 0, 9.0, 0.1)]    # another session shares nothing
    assert seen_prefix_words(reqs, prompts) == [0, 4, 0, 4, 0]
    reqs[3]["start"] = 2.6  # now s1 (first token at 2.5) counts: 6 words
    assert seen_prefix_words(reqs, prompts)[3] == 6
    reqs[1]["ttft"] = math.nan  # a request that never streamed computed nothing we can count
    assert seen_prefix_words(reqs, prompts)[3] == 4


def test_turn_reuse_against_new_tokens_plus_one_block():
    from reuse import reuse_summary, turn_reuse

    reqs = [_req("s", 0, 0.0, 0.1, prompt_tokens=100, cached=0, sent=100),
            # 100 of 140 words seen; cache hit 96 (6 blocks of 16): computes 44 = new + 4
            _req("s", 1, 1.0, 0.1, prompt_tokens=140, cached=96, sent=140, seen=100),
            # 140 of 200 seen, but only 64 cached: computes 136 = new + 76
            _req("s", 2, 2.0, 0.1, prompt_tokens=200, cached=64, sent=200, seen=140),
            _req("s", 3, 3.0, math.nan, ok=False, sent=210, seen=200),
            # s2 resent unchanged: all seen, the engine recomputes the last block (16)
            _req("s", 4, 4.0, 0.1, prompt_tokens=200, cached=184, sent=200, seen=200),
            # an engine that adds one token (BOS) and caches it with the first block
            _req("t", 0, 0.0, 0.1, prompt_tokens=51, cached=0, sent=50),
            _req("t", 1, 1.0, 0.1, prompt_tokens=71, cached=48, sent=70, seen=50)]
    turns = turn_reuse(reqs)
    got = [(t.session, t.turn, t.new_tokens, t.computed_tokens, t.excess) for t in turns]
    assert got == [("s", 1, 40, 44, 4), ("s", 2, 60, 136, 76), ("s", 4, 0, 16, 16),
                   ("t", 1, 20, 23, 3)]
    s = reuse_summary(turns, block_size=16)
    assert (s["turns"], s["within_bound"], s["worst_excess"], s["worst_turn"]) == (4, 3, 76, "s#2")
    assert (s["new_tokens"], s["computed_tokens"], s["prompt_offsets"]) == (120, 219, [0, 1])
    assert reuse_summary(turns, block_size=128)["within_bound"] == 4
    reqs[1]["cached_tokens"] = None  # an engine that does not report cached tokens
    assert turn_reuse(reqs) is None


def test_judge_point_takes_the_percentile_and_fails_on_errors():
    from capacity import judge_point

    ttfts = [0.1 * i for i in range(1, 21)]  # 0.1 .. 2.0 s
    p90 = float(np.percentile(ttfts, 90))  # 1.81 s
    ok = judge_point(4, ttfts, failed=0, slo_ttft_s=2.0, q=90)
    assert ok.passed and ok.reason == "" and ok.ttft_ms == pytest.approx(p90 * 1000)
    assert ok.requests == 20
    over = judge_point(4, ttfts, failed=0, slo_ttft_s=1.8, q=90)
    assert not over.passed and "p90 TTFT 1810 ms > 1800 ms" == over.reason
    assert judge_point(4, ttfts, failed=0, slo_ttft_s=1.8, q=50).passed
    broken = judge_point(4, ttfts, failed=1, slo_ttft_s=2.0, q=90)
    assert not broken.passed and broken.reason == "1 of 21 requests failed"
    assert not judge_point(4, [], failed=0, slo_ttft_s=2.0, q=90).passed


def test_max_sessions_at_slo_is_the_last_of_the_leading_passes():
    from capacity import PointVerdict, max_sessions_at_slo

    def v(n, passed):
        return PointVerdict(n, 100.0, 10, 0, passed, "" if passed else "slow")

    assert max_sessions_at_slo([v(1, True), v(2, True), v(4, False)]) == (2, False)
    # a pass above a failure does not count (noise, or run without stopping)
    assert max_sessions_at_slo([v(8, True), v(1, True), v(4, False), v(2, True)]) == (2, False)
    assert max_sessions_at_slo([v(1, False)]) == (0, False)
    assert max_sessions_at_slo([v(1, True), v(2, True)]) == (2, True)  # a lower bound
    assert max_sessions_at_slo([v(1, True), v(2, True), v(2, False)]) == (1, False)  # repeats
    assert max_sessions_at_slo([]) == (0, False)


def test_capacity_table_reports_the_leading_passes_per_engine():
    import report

    def run(n, ttft_ms, passed):
        return {"capacity": {"sessions": n, "ttft_ms": ttft_ms, "requests": 40, "failed": 0,
                             "passed": passed, "reason": "", "slo_ttft_s": 2.0, "percentile": 90.0}}

    runs = {"tokenmill": {("claude-code-capacity", "1 session"): [run(1, 500.0, True)],
                          ("claude-code-capacity", "2 sessions"): [run(2, 2500.0, False)]},
            "vllm": {("claude-code-capacity", "1 session"): [run(1, 400.0, True)],
                     ("claude-code-capacity", "2 sessions"): [run(2, 900.0, True)]}}
    lines = report.capacity_table(runs).splitlines()
    assert lines[0].startswith("SLO: p90 TTFT <= 2000 ms")
    assert lines[2:] == ["| engine | max sessions at SLO | 1 | 2 |", "|---|---|---|---|",
                         "| tokenmill | 1 | 500 (40/40) | 2500 x (40/40) |",
                         "| vllm | >= 2 | 400 (40/40) | 900 (40/40) |"]
