"""Fast checks of the serving benchmark's pure parts: percentiles, goodput, trace scaling."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "serving"))

import workloads as wl  # noqa: E402
from stats import RequestResult, Slo, percentile, summarize  # noqa: E402

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

    import loadgen
    from loadgen import Session, Target, Turn

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

    import loadgen
    from loadgen import Session, Target, Turn

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
