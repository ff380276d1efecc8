"""Pipeline parallel over the "mp" executor and gloo: greedy tokens with pp=2 (tied head)
and tp=2 x pp=2 (untied head, 4 processes) are identical to one process, with chunked
prefill and KV preemption; micro-batches overlap in the pipeline and one prompt's chunks
flow through the stages together; each stage holds its layers' weights and KV only; a
killed stage fails the engine's requests cleanly; bad sizes fail before any process."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineArgs
from tokenmill.engine.in_flight import InFlightStep
from tokenmill.engine.llm_engine import EngineDeadError
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.model.pipeline import stage_layers
from tokenmill.platforms.step import StepResult
from tokenmill.sampling_params import SamplingParams as Params

# the last prompt is longer than a step's budget: its prefill takes several chunks
PROMPTS = [
    "The quick brown fox", "Paris is the capital of France; Berlin is", "def main():",
    "tokenmill turns any accelerator into tokens, one step at a time.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# 16 blocks of 4 tokens for 4 sequences of ~10 to ~50 tokens: preemption happens
SMALL_KV = {"num_kv_blocks": 16, "max_num_batched_tokens": 16, "max_model_len": 64}


def _llm(path, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    return LLM(str(path), dtype="float32", block_size=4, platform="cpu", **kw)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    """One process's greedy tokens (roomy and small KV), KV block and parameter bytes."""
    out = {}
    for arch in ("llama", "qwen2"):
        llm = _llm(tiny_dirs[arch], max_num_batched_tokens=16)
        rpc = llm.engine.executor.collective_rpc
        out[arch] = (_tokens(llm), rpc("kv_block_bytes")[0], rpc("parameter_bytes")[0])
        llm.engine.shutdown()
    small = _llm(tiny_dirs["llama"], **SMALL_KV)
    out["small"] = _tokens(small)
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.shutdown()
    return out


def test_stage_layers_split_evenly():
    assert [stage_layers(5, 2, s) for s in range(2)] == [range(0, 3), range(3, 5)]
    assert [len(stage_layers(8, 3, s)) for s in range(3)] == [3, 3, 2]
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2"):
        stage_layers(2, 3, 0)


def test_pp2_matches_one_process_overlaps_then_a_killed_stage_fails_cleanly(
    tiny_dirs, reference
):
    llm = _llm(tiny_dirs["llama"], pipeline_parallel_size=2, max_num_batched_tokens=16)
    engine = llm.engine
    try:
        assert engine.args.distributed_executor_backend == "mp"
        assert len(engine.executor.pids) == 2
        want, full_block_bytes, full_param_bytes = reference["llama"]
        assert _tokens(llm) == want
        queue = engine.in_flight
        assert queue.depth == 2 and queue.num_overlapped > 0  # micro-batches overlapped
        assert queue.num_chunks_overlapped > 0  # the long prompt's chunks did too
        rpc = engine.executor.collective_rpc
        # one layer per stage: half the KV; the tied embedding is on both stages (input
        # on the first, head on the last), each layer's weights on one only
        assert rpc("kv_block_bytes") == [full_block_bytes // 2] * 2
        per_stage = rpc("parameter_bytes")
        assert max(per_stage) < full_param_bytes, (per_stage, full_param_bytes)
        assert sum(per_stage) > full_param_bytes  # the tied table twice: nothing missing
        # the activations went stage to stage through the pp group's communicator
        assert rpc("communicated_bytes", ("pp",))[0] > 0

        tok = llm.get_tokenizer()
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(f"r{i}", tok.encode(prompt), params, prompt=prompt)
        engine.step()
        os.kill(engine.executor.pids[1], signal.SIGKILL)
        start = time.monotonic()
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0]
            assert time.monotonic() - start < 15, "the engine did not notice the dead stage"
        assert sorted(finished) == ["r0", "r1", "r2"]
        assert {o.finish_reason for o in finished.values()} == {
            RequestStatus.FINISHED_ERROR.value
        }
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            engine.add_request("late", tok.encode("hi"), params)
    finally:
        engine.shutdown()


def test_pp2_with_preemption_matches_one_process(tiny_dirs, reference):
    """Preempting a request whose step is in flight drops that step's token for it; it
    is recomputed and resumes exactly."""
    llm = _llm(tiny_dirs["llama"], pipeline_parallel_size=2, **SMALL_KV)
    try:
        assert _tokens(llm) == reference["small"]
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.shutdown()


def test_tp2_x_pp2_matches_one_process(tiny_dirs, reference):
    llm = _llm(tiny_dirs["qwen2"], tensor_parallel_size=2, pipeline_parallel_size=2,
               max_num_batched_tokens=16)
    try:
        assert len(llm.engine.executor.pids) == 4
        want, full_block_bytes, full_param_bytes = reference["qwen2"]
        assert _tokens(llm) == want
        rpc = llm.engine.executor.collective_rpc
        # 2 KV heads over tp 2 and 2 layers over pp 2: a quarter of the KV per rank
        assert rpc("kv_block_bytes") == [full_block_bytes // 4] * 4
        per_rank = rpc("parameter_bytes")
        assert max(per_rank) < full_param_bytes / 2, (per_rank, full_param_bytes)
        # results come from TP rank 0 of the last stage: rank 2
        assert llm.engine.executor.config.output_rank == 2
    finally:
        llm.engine.shutdown()


def _request(rid: str) -> Request:
    request = Request(request_id=rid, prompt_token_ids=[1, 2, 3],
                      sampling_params=Params(max_tokens=4))
    request.status = RequestStatus.RUNNING
    return request


def test_a_collected_step_drops_what_changed_while_it_was_in_flight():
    live, preempted = _request("a"), _request("b")  # "c" finished: no longer known
    step = InFlightStep(SchedulerOutput(), None, {"a": 0, "b": 0, "c": 0})
    preempted.num_preemptions = 1  # preempted (and maybe rescheduled) since submission
    result = StepResult(sampled_token_ids={"a": 5, "b": 6, "c": 7})
    kept = step.current(result, {"a": live, "b": preempted})
    assert kept.sampled_token_ids == {"a": 5}


def test_bad_pp_sizes_fail_before_any_process_starts(tiny_dirs):
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2"):
        _llm(tiny_dirs["llama"], pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="x pipeline_parallel_size=2 needs a process per rank"):
        EngineArgs(pipeline_parallel_size=2, distributed_executor_backend="uni")
    assert EngineArgs(pipeline_parallel_size=2).distributed_executor_backend == "mp"
    assert EngineArgs(pipeline_parallel_size=2, tensor_parallel_size=2).world_size == 4


def test_serve_pp_flag_is_validated(capsys):
    from tokenmill.server.cli import main

    assert main(["serve", "--pipeline-parallel-size", "0", "--port", "1"]) == 2
    assert "pipeline_parallel_size" in capsys.readouterr().err
    assert main(["serve", "-pp", "2", "--distributed-executor-backend", "uni", "--port", "1"]) == 2
    assert "distributed_executor_backend='uni'" in capsys.readouterr().err


def test_a_stage_keeps_the_models_kv_groups_with_its_slots_renumbered():
    import torch

    from tokenmill.kv.groups import plan_groups
    from tokenmill.model.pipeline import stage_kv_layout
    from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
    from tokenmill.platforms.ops.linear_attention import gated_delta_state_spec

    full = AttentionSpec(AttentionKind.FULL, 4, 2, 16, torch.float32, 4)
    state = gated_delta_state_spec(96, 4, 4, 16, 8, torch.float32)
    linear = AttentionSpec(AttentionKind.LINEAR, 4, 2, 16, torch.float32, 4, state=state)
    # Qwen3-Next's pattern: three recurrent layers, then full attention; gcd 1, so four
    # groups of one layer sharing one slot
    model = plan_groups([linear, linear, linear, full])
    first, last = stage_kv_layout(model, range(0, 2)), stage_kv_layout(model, range(2, 4))
    assert first.groups == last.groups == model.groups  # the engine's numbering
    assert (first.layer_group, first.layer_slot, first.num_slots) == ((0, 1), (0, 0), 1)
    assert (last.layer_group, last.layer_slot, last.num_slots) == ((2, 3), (0, 0), 1)
    # one type: one group of every layer; the second stage's slots 2, 3 become 0, 1
    plain = stage_kv_layout(plan_groups([full] * 4), range(2, 4))
    assert (plain.layer_group, plain.layer_slot, plain.num_slots) == ((0, 0), (0, 1), 2)
