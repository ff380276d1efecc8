"""Tensor parallel over the "mp" executor and gloo: greedy tokens with tp=2 and tp=4
(4 query heads, 2 KV heads: tp=4 replicates each KV head on two ranks) are identical to
one process; each rank's KV pool holds its own heads only; a killed TP worker fails the
engine's requests cleanly; bad sizes fail before any process starts."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineArgs
from tokenmill.engine.llm_engine import EngineDeadError
from tokenmill.engine.request import RequestStatus

PROMPTS = ["The quick brown fox", "Paris is the capital of France; Berlin is", "def main():"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, platform="cpu", num_kv_blocks=64, **kw)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    """One process's greedy tokens, KV block size and parameter bytes per model."""
    out = {}
    for arch in ("llama", "qwen2"):
        llm = _llm(tiny_dirs[arch])
        rpc = llm.engine.executor.collective_rpc
        out[arch] = (_tokens(llm), rpc("kv_block_bytes")[0], rpc("parameter_bytes")[0])
        llm.engine.shutdown()
    return out


def _check_tp(llm: LLM, reference, arch: str, tp: int) -> None:
    assert llm.engine.args.distributed_executor_backend == "mp"  # picked for tp > 1
    assert len(llm.engine.executor.pids) == tp
    want_tokens, full_block_bytes, full_param_bytes = reference[arch]
    assert _tokens(llm) == want_tokens
    rpc = llm.engine.executor.collective_rpc
    # each rank caches its KV heads only: 2 KV heads split over 2 ranks, or one
    # (replicated) per rank with 4
    assert rpc("kv_block_bytes") == [full_block_bytes // 2] * tp
    # weights are sharded on load: no rank holds more than its share (plus the small
    # replicated norms, biases and, at tp=4, the replicated KV projections)
    per_rank = rpc("parameter_bytes")
    assert max(per_rank) < full_param_bytes / tp * 1.25, (per_rank, full_param_bytes)
    assert sum(per_rank) >= full_param_bytes


@pytest.mark.parametrize("arch, tp", [("llama", 4), ("qwen2", 2)])
def test_tp_matches_one_process_token_for_token(tiny_dirs, reference, arch, tp):
    llm = _llm(tiny_dirs[arch], tensor_parallel_size=tp)
    try:
        _check_tp(llm, reference, arch, tp)
    finally:
        llm.engine.shutdown()


def test_tp2_matches_then_a_killed_worker_fails_requests_cleanly(tiny_dirs, reference):
    llm = _llm(tiny_dirs["llama"], tensor_parallel_size=2)
    _check_tp(llm, reference, "llama", 2)
    engine = llm.engine
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", tok.encode(prompt), params, prompt=prompt)
    engine.step()
    pid = engine.executor.pids[1]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        assert time.monotonic() - start < 15, "the engine did not notice the dead TP worker"
    assert sorted(finished) == ["r0", "r1", "r2"]
    for out in finished.values():
        assert out.finish_reason == RequestStatus.FINISHED_ERROR.value
    assert not engine.is_healthy
    with pytest.raises(EngineDeadError):
        engine.add_request("late", tok.encode("hi"), params)
    engine.shutdown()


def test_bad_tp_sizes_fail_before_any_process_starts(tiny_dirs):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        _llm(tiny_dirs["llama"], tensor_parallel_size=3)
    with pytest.raises(ValueError, match="distributed_executor_backend='uni'"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni")
    assert EngineArgs(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert EngineArgs().distributed_executor_backend == "uni"


def test_serve_flag_is_validated(capsys):
    from tokenmill.server.cli import main

    assert main(["serve", "--tensor-parallel-size", "0", "--port", "1"]) == 2
    assert "tensor_parallel_size" in capsys.readouterr().err
    argv = ["serve", "-tp", "2", "--distributed-executor-backend", "uni", "--port", "1"]
    assert main(argv) == 2
    assert "distributed_executor_backend='uni'" in capsys.readouterr().err


def test_tp1_builds_the_plain_model(tiny_dirs):
    """tp=1: no parallel module, so no communicator call, in the model."""
    from tokenmill.model.linear import RowParallelLinear, VocabParallelEmbedding

    llm = _llm(tiny_dirs["llama"])
    model = llm.engine.executor.worker.runner.model
    kinds = {type(m) for m in model.modules()}
    assert not kinds & {RowParallelLinear, VocabParallelEmbedding}
    assert not any(getattr(m, "shard_rules", None) for m in model.modules())
    assert model.tp.communicator is None
    llm.engine.shutdown()
