"""The step description and result: msgpack round trips of every field, and the worker's
request table rebuilt from the steps alone (no access to the scheduler's requests)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.kv.manager import KVCacheManager
from tokenmill.platforms.kit.runner_state import RequestStateTable, StepProtocolError
from tokenmill.platforms.kv_handover import (
    ArenaGeometry,
    EngineEndpoint,
    HandoverReport,
    HandoverStepMeta,
    PullJob,
    PullResult,
    RankEndpoint,
)
from tokenmill.platforms.kv_messages import (
    BlockTransfer,
    ConnectorStepMeta,
    EvictedBlock,
    LoadJob,
    LoadResult,
    PrefetchJob,
    TierChange,
    WorkerReport,
)
from tokenmill.platforms.kv_tier import TierStats
from tokenmill.platforms.step import (
    CachedRequest,
    Logprobs,
    NewRequest,
    RecurrentStateOps,
    SamplingSpec,
    StepDescription,
    StepResult,
    StructuredMasks,
    decode_result,
    decode_step,
    encode,
)
from tokenmill.sampling_params import SamplingParams


def full_step() -> StepDescription:
    """A step with every field set to something other than its default."""
    sampling = SamplingSpec(
        temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=-0.5, min_tokens=3, stop_token_ids=[7, 8],
        eos_token_ids=[2], ignore_eos=True, logprobs=4, prompt_logprobs=2,
        logit_bias={3: -100.0, 9: 2.5},
    )
    words = np.array([[-1, 0x7FFFFFFF, -(2**31)], [5, 6, 7]], dtype="<i4")
    return StepDescription(
        step_id=12,
        new_requests=[
            NewRequest("a", [1, 2, 3], [9, 10], sampling, 1234, [4, 5], 2, [[0, 8], [3]]),
            NewRequest("b", [4], [], SamplingSpec(), None, [6], 0),
        ],
        cached_requests=[CachedRequest("c", [11], [7], 40, [[12], []], [3, 1, 0])],
        scheduled_request_ids=["a", "b", "c"],
        num_scheduled_tokens=[3, 1, 3],
        finished_request_ids=["d"],
        aborted_request_ids=["e"],
        preempted_request_ids=["f"],
        prompt_logprob_ranges={"a": (2, 4)},
        structured=StructuredMasks(words.tobytes(), 3, [0, 2], [2]),
        kv_connector=ConnectorStepMeta(
            loads=[LoadJob("g", [BlockTransfer(4, b"k" * 32)])],
            saves=[BlockTransfer(1, b"s" * 32)],
            demotes=[EvictedBlock(7, b"d" * 32, 0.5)],
            prefetch=[PrefetchJob("w", [b"p" * 32])],
            unpin=["w"],
        ),
        recurrent_state={"a": [RecurrentStateOps(1, [20, 21], [(4, [22, 23])])]},
        spec_token_ids={"c": [30, 31]},
        kv_handover=HandoverStepMeta(
            peers=[EngineEndpoint("p", "nixl", "m", "float32", 16, "l", 1, [RankEndpoint(
                b"desc", 4096, ArenaGeometry(8, 256, 2, 2))])],
            pulls=[PullJob("a", "p", [(3, 4)], 20.0)],
        ),
    )


def full_result() -> StepResult:
    lp = Logprobs(token_ids=[5, 5, 1], logprobs=[-0.25, -0.25, -1.5], ranks=[1, 1, 2])
    return StepResult(
        sampled_token_ids={"a": 5, "c": 1},
        logprobs={"a": lp},
        accepted_token_ids={"c": [30]},
        accepted_logprobs={"c": [lp]},
        draft_token_ids={"c": [31, 32]},
        prompt_logprobs={"a": (2, [lp, lp])},
        kv_connector=WorkerReport(
            loads=[LoadResult("g", 1, 2, ["host"])], saved_keys=[b"s" * 32],
            failed_save_keys=[b"t" * 32], num_prefetched=1, demoted_keys=[b"d" * 32],
            step_tokens=3, step_seconds=0.25,
            tier_changes=[TierChange("host", b"s" * 32, True)],
            tier_stats={"host": TierStats(hits=1, bytes_written=64)},
        ),
        kv_handover=HandoverReport(
            results=[PullResult("a", True, 512, 0.5, "none")], transport_bytes=512),
    )


def _non_default_fields(struct: msgspec.Struct) -> None:
    """Every field differs from its default, so a field added later must enter the test."""
    for field in msgspec.structs.fields(struct):
        value = getattr(struct, field.name)
        if field.default is not msgspec.NODEFAULT:
            assert value != field.default, f"{type(struct).__name__}.{field.name} is default"
        elif field.default_factory is not msgspec.NODEFAULT:
            assert value != field.default_factory(), f"{type(struct).__name__}.{field.name}"
        if isinstance(value, msgspec.Struct):
            _non_default_fields(value)


def test_every_field_of_the_step_round_trips():
    step = full_step()
    _non_default_fields(step)
    _non_default_fields(step.new_requests[0])
    _non_default_fields(step.new_requests[0].sampling)
    _non_default_fields(step.cached_requests[0])
    _non_default_fields(step.recurrent_state["a"][0])
    decoded = decode_step(encode(step))
    assert decoded == step
    assert decoded.prompt_logprob_ranges["a"] == (2, 4)  # tuples come back as tuples
    words = np.frombuffer(decoded.structured.bitmask, "<i4").reshape(-1, 3)
    assert words.tolist() == [[-1, 0x7FFFFFFF, -(2**31)], [5, 6, 7]]
    assert decoded.new_requests[0].sampling.greedy is False
    assert SamplingSpec(temperature=0).greedy


def test_every_field_of_the_result_round_trips():
    result = full_result()
    _non_default_fields(result)
    _non_default_fields(result.logprobs["a"])
    assert decode_result(encode(result)) == result


def test_decoding_checks_the_schema():
    bad = msgspec.msgpack.encode({"step_id": "twelve"})
    with pytest.raises(msgspec.ValidationError, match="step_id"):
        decode_step(bad)


def _scheduler(num_blocks: int = 8) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=6, max_model_len=64), kv)


def test_worker_table_follows_the_scheduler_through_steps_and_preemption():
    """The worker rebuilds every scheduled request's tokens, blocks and positions from the
    encoded steps alone, including after a preemption, and drops what ended."""
    scheduler = _scheduler(num_blocks=5)
    table = RequestStateTable("cpu")
    params = SamplingParams(temperature=0.5, seed=3, max_tokens=40)
    for rid, prompt in (("a", list(range(1, 8))), ("b", list(range(20, 25)))):
        scheduler.add_request(Request(rid, prompt, params, seed=3))
    seen_new: list[str] = []
    ended: list[str] = []
    for step_no in range(30):
        plan = scheduler.schedule()
        if plan.is_empty:
            break
        step = decode_step(encode(plan.step))
        assert step.step_id == step_no
        seen_new += [n.request_id for n in step.new_requests]
        ended += step.finished_request_ids
        rows = table.update(step)
        for row, item in zip(rows, plan.scheduled, strict=True):
            assert row.state.request_id == item.request_id
            assert row.start == item.start_position
            assert row.state.token_ids(row.start, row.start + row.num_tokens) == item.token_ids
            assert row.state.block_ids == item.block_ids
            assert row.sample == item.sample
        scheduler.update_computed(plan)
        for item in plan.scheduled:
            request = scheduler.requests[item.request_id]
            if item.sample:
                request.append_output_token(100 + request.num_tokens)
                if request.num_output_tokens == 6:
                    scheduler.finish(item.request_id, request.status.FINISHED_LENGTH)
    assert scheduler.num_preemptions > 0
    assert len(seen_new) > 2  # preempted requests came back whole
    plan = scheduler.schedule()
    assert plan.is_empty and not scheduler.has_unfinished_requests()
    # ended ids reach the workers once, with the next step run
    ended += scheduler.workers.describe_step([], []).finished_request_ids
    assert sorted(ended) == ["a", "b"]
    assert len(table) == 1  # the last one to finish is dropped by the next step


def test_a_step_naming_an_unknown_request_is_refused():
    table = RequestStateTable("cpu")
    step = StepDescription(step_id=3, cached_requests=[CachedRequest("x", [1], [], 0)])
    with pytest.raises(StepProtocolError, match="step 3 refers to request 'x'"):
        table.update(step)
