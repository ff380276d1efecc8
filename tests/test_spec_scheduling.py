"""The scheduler-side parts of speculative decoding: the adaptive planner's cost model
and decisions, recurrent-state snapshots, KV trimming of rejected drafts."""

from __future__ import annotations

import pytest

from tokenmill.engine.request import Request
from tokenmill.kv.block_pool import BlockPool
from tokenmill.kv.manager import KVCacheManager
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.adaptive import AdaptivePlanner, StepCostModel
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.snapshots import StateSnapshots


def test_cost_model_recovers_a_line():
    model = StepCostModel()
    assert model.fit() is None
    model.observe(1, 0.0102)
    assert model.fit() is None  # one step size does not determine a and b
    for tokens in (1, 17, 64, 300, 5, 9):
        model.observe(tokens, 0.010 + 0.0002 * tokens)
    a, b = model.fit()
    assert a == pytest.approx(0.010, rel=1e-6) and b == pytest.approx(0.0002, rel=1e-6)


def _planner(a: float, b: float) -> AdaptivePlanner:
    planner = AdaptivePlanner()
    for tokens in (1, 8, 64, 512):
        planner.cost.observe(tokens, a + b * tokens)
    return planner


def test_planner_drafts_at_batch_1_and_stops_at_a_compute_bound_batch():
    drafts = [7, 8, 9, 10]
    weight_bound = _planner(a=0.010, b=0.0001)
    assert weight_bound.plan({"r": drafts}, num_rows=1) == {"r": 4}
    compute_bound = _planner(a=0.010, b=0.002)
    proposals = {f"r{i}": drafts for i in range(64)}
    planned = compute_bound.plan(proposals, num_rows=64)
    # q = 0.7^i must beat b (B + A) / (a + b (B + D)) ~ 0.93: nothing passes
    assert sum(planned.values()) == 0


def test_planner_stops_a_failing_request_and_probes_it_again():
    planner = _planner(a=0.010, b=0.005)
    for _ in range(6):
        planner.record("bad", 4, 0)
        planner.record("good", 4, 4)
    planned = planner.plan({"bad": [1, 2, 3, 4], "good": [1, 2, 3, 4]}, num_rows=2)
    assert planned["good"] == 4 and planned["bad"] == 0
    assert planner.may_draft("good", 2) and not planner.may_draft("bad", 2)
    planner.records["bad"].steps_since_offer -= 1  # the may_draft above counted a step
    for _ in range(planner.probe_interval - 2):
        assert planner.plan({"bad": [1, 2]}, num_rows=1)["bad"] == 0
    assert planner.plan({"bad": [1, 2]}, num_rows=1)["bad"] == 1  # a probe
    off = AdaptivePlanner(enabled=False)
    assert off.plan({"x": [1, 2, 3]}, num_rows=64) == {"x": 3}


def test_snapshots_never_write_the_set_they_restore_from():
    pool = BlockPool(64)
    snaps = StateSnapshots(pool, {1: 2}, num_sets=4)  # k = 3, a state of 2 pages
    assert snaps.ensure("r") and pool.num_free_blocks == 64 - 8
    ops = snaps.step_ops("r", start=10, num_drafts=3)
    restore, written = ops[1]
    assert restore == [] and [n for n, _ in written] == [11, 12, 13]
    snaps.verified("r", 3, 1)  # one accepted: the state after 2 of the step's tokens
    restore, written = snaps.step_ops("r", start=12, num_drafts=3)[1]
    assert restore == ops[1][1][1][1]  # the snapshot written at n = 12
    assert restore not in [pages for _, pages in written]
    snaps.verified("r", 3, 3)  # all accepted: the slot holds it, nothing to restore
    restore, _ = snaps.step_ops("r", start=16, num_drafts=2)[1]
    assert restore == []
    assert not StateSnapshots(pool, {1: 30}, num_sets=4).ensure("big")  # does not fit
    snaps.release("r")
    assert pool.num_free_blocks == 64


def test_trim_gives_back_only_blocks_past_the_tokens():
    kv = KVCacheManager(32, 4)
    request = Request("r", list(range(9)), SamplingParams(max_tokens=20))
    assert kv.allocate_slots(request, 9)
    request.num_computed_tokens = 9
    request.append_output_token(100)
    assert kv.allocate_slots(request, 1, num_lookahead_tokens=6)  # 10 + 6 tokens: 4 blocks
    assert len(kv.block_ids(request)) == 4
    request.num_computed_tokens = 10 + 1  # one draft accepted
    request.append_output_token(101)
    request.append_output_token(102)
    assert kv.trim(request, request.num_tokens) == [3]
    assert len(kv.block_ids(request)) == 3 and kv.pool.num_free_blocks == 32 - 3
    assert kv.trim(request, request.num_tokens) is None
    # the lookahead's blocks were never published: only the request's full blocks are
    assert len(request.block_hashes) == 2


def test_config_refuses_bad_shapes():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=6)
    with pytest.raises(ValueError, match="draft head"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=4)
    with pytest.raises(ValueError, match="not JSON"):
        SpeculativeConfig.parse("{method: suffix}")
    with pytest.raises(ValueError, match="extra"):
        SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 2, "k": 1})


def test_cost_prior_anchors_the_fit_against_noisy_steps():
    model = StepCostModel(prior=((1, 0.024), (256, 0.55)))
    a, b = model.fit()
    assert a == pytest.approx(0.024 - (0.55 - 0.024) / 255, rel=1e-6)
    for _ in range(30):  # a loaded machine: decode steps of 1 and 9 rows, times all over
        model.observe(1, 0.30)
        model.observe(9, 0.25)
    a, b = model.fit()
    assert b > 0.001  # measured noise alone (a negative slope) would say compute is free


def test_outcome_guard_turns_drafts_off_where_they_measured_slower():
    planner = AdaptivePlanner()
    guard = planner.guard
    for _ in range(5):  # batch 64: drafts measured at 40 tok/s, plain steps at 100
        guard.observe(64, 64 * 3, 4.8, drafted=True)
        guard.observe(64, 64, 0.64, drafted=False)
        guard.observe(1, 4, 0.05, drafted=True)  # batch 1: 80 tok/s with drafts
        guard.observe(1, 1, 0.04, drafted=False)  # 25 without
    allowed_64 = [planner.start_step(64) for _ in range(32)]
    assert sum(allowed_64) == 2  # only the probes
    assert not planner.may_draft("r", 64) or planner._step_allowed
    allowed_1 = [planner.start_step(1) for _ in range(32)]
    assert sum(allowed_1) == 30  # all but the plain probes
