"""Executors: the "mp" executor (a real worker process per rank, spawned, steps over ZMQ)
gives the same tokens as the in-process "uni" one, and a worker killed with SIGKILL fails
the engine's requests with an error naming it within seconds, never a hang."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import EngineDeadError
from tokenmill.engine.request import RequestStatus

PROMPTS = ["The quick brown fox", "Paris is the capital of France; Berlin is", "def main():"]


def _llm(path, backend: str, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    return LLM(str(path), dtype="float32", block_size=4, platform="cpu",
               distributed_executor_backend=backend, **kw)


@pytest.fixture(scope="module")
def mp_llm(tiny_dirs):
    llm = _llm(tiny_dirs["llama"], "mp")
    yield llm
    llm.engine.shutdown()


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True,
                            logprobs=2, repetition_penalty=1.3)
    return [greedy, seeded, greedy]


def test_mp_matches_uni_token_for_token(tiny_dirs, mp_llm):
    uni = _llm(tiny_dirs["llama"], "uni")
    want = uni.generate(PROMPTS, _params(), use_tqdm=False)
    got = mp_llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[1].outputs[0].logprobs == want[1].outputs[0].logprobs
    assert mp_llm.engine.executor.pids[0] != os.getpid()


def test_mp_with_preemption_matches_uni(tiny_dirs):
    """Preempted requests are re-sent whole to the worker process and resume exactly."""
    kw = {"num_kv_blocks": 24, "max_model_len": 64, "max_num_batched_tokens": 16}
    uni = _llm(tiny_dirs["llama"], "uni", **kw)
    mp = _llm(tiny_dirs["llama"], "mp", **kw)
    try:
        prompts = PROMPTS * 2
        params = _params() * 2
        want = uni.generate(prompts, params, use_tqdm=False)
        got = mp.generate(prompts, params, use_tqdm=False)
        assert mp.engine.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    finally:
        mp.engine.shutdown()


def test_killed_worker_fails_requests_fast_and_clearly(tiny_dirs):
    llm = _llm(tiny_dirs["llama"], "mp")
    engine = llm.engine
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", tok.encode(prompt), params, prompt=prompt)
    engine.step()
    engine.step()
    (pid,) = engine.executor.pids
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        assert time.monotonic() - start < 10, "the engine did not notice the dead worker"
    elapsed = time.monotonic() - start
    assert elapsed < 5, elapsed
    assert sorted(finished) == ["r0", "r1", "r2"]
    for out in finished.values():
        assert out.finish_reason == RequestStatus.FINISHED_ERROR.value
        assert f"worker rank 0 (pid {pid}) died with exit code -9" in out.stop_reason
    assert not engine.is_healthy
    with pytest.raises(EngineDeadError, match="killed by signal 9"):
        engine.add_request("late", tok.encode("hi"), params)
    assert engine.kv.usage == 0.0


def test_worker_dying_while_idle_makes_the_engine_unhealthy(tiny_dirs):
    llm = _llm(tiny_dirs["llama"], "mp")
    engine = llm.engine
    assert engine.is_healthy
    (pid,) = engine.executor.pids
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while engine.is_healthy:
        assert time.monotonic() < deadline, "the dead worker went unnoticed"
        time.sleep(0.05)
    with pytest.raises(EngineDeadError, match=f"pid {pid}"):
        engine.check_health()


def test_mp_refuses_an_in_process_registry(tiny_dirs):
    from tokenmill.platforms.registry import PlatformRegistry
    from tokenmill_cpu import plugin

    registry = PlatformRegistry()
    registry.register_plugin(plugin, "cpu")
    with pytest.raises(ValueError, match="in-process registry cannot cross"):
        LLM(str(tiny_dirs["llama"]), platform="cpu", registry=registry,
            distributed_executor_backend="mp", num_kv_blocks=16)


def test_steps_reach_every_rank_and_errors_name_the_rank(tiny_dirs):
    """Two ranks (a tensor-parallel pair: every rank of a world belongs to its parallel
    layout) get every step; rank 0's result equals the in-process worker's (tokens exactly,
    logprobs to float tolerance: tp sums in another order); a bad step fails naming the rank,
    and a rank whose answer nobody reads dies with it (the monitor reports the exit)."""
    from tokenmill.distributed.errors import WorkerCallError, WorkerDiedError
    from tokenmill.distributed.executor import UniExecutor
    from tokenmill.distributed.mp import MultiprocExecutor
    from tokenmill.engine.config import EngineConfig
    from tokenmill.model.loader import load_model_info
    from tokenmill.platforms.interfaces import ParallelConfig
    from tokenmill.platforms.registry import load_platform
    from tokenmill.platforms.step import CachedRequest, NewRequest, SamplingSpec, StepDescription

    info = load_model_info(str(tiny_dirs["llama"]), load_tokenizer=False)
    config = EngineConfig(
        model_path=info.model_path, platform="cpu", dtype="float32", block_size=4,
        max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128, seed=0, num_kv_blocks=16,
    )
    uni = UniExecutor(config, load_platform("cpu"), info.hf_config)
    mp = MultiprocExecutor(msgspec_replace(
        config, parallel=ParallelConfig(world_size=2, tensor_parallel_size=2,
                                        distributed_executor_backend="mp"),
        dist_init_method=f"tcp://127.0.0.1:{_free_port()}",
    ))
    try:
        assert uni.initialize() == mp.initialize() == 16
        assert mp.collective_rpc("determine_num_blocks") == [16, 16]
        first = StepDescription(
            step_id=0, new_requests=[NewRequest("a", [5, 6, 7, 8, 9], [], SamplingSpec(
                temperature=0, logprobs=1), None, [0, 1], 0)],
            scheduled_request_ids=["a"], num_scheduled_tokens=[5],
        )
        want, got = uni.execute(first), mp.execute(first)
        _same_result(got, want)
        assert list(got.sampled_token_ids) == ["a"]
        token = got.sampled_token_ids["a"]
        second = StepDescription(
            step_id=1, cached_requests=[CachedRequest("a", [token], [], 5)],
            scheduled_request_ids=["a"], num_scheduled_tokens=[1],
        )
        _same_result(mp.execute(second), uni.execute(second))  # rank 1 held "a" too, or it died
        mp.check_health()
        bad = StepDescription(step_id=2, cached_requests=[CachedRequest("zzz", [], [], 0)])
        with pytest.raises(WorkerCallError, match=r"(?s)rank 0 failed in execute.*'zzz'"):
            mp.execute(bad)
        deadline = time.monotonic() + 15
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 .* exit code 1"):
            while time.monotonic() < deadline:
                mp.check_health()
                time.sleep(0.05)
    finally:
        mp.shutdown()
        uni.shutdown()


def _same_result(got, want) -> None:
    assert got.sampled_token_ids == want.sampled_token_ids
    assert got.logprobs.keys() == want.logprobs.keys()
    for rid, lp in got.logprobs.items():
        assert lp.token_ids == want.logprobs[rid].token_ids
        assert lp.logprobs == pytest.approx(want.logprobs[rid].logprobs, abs=1e-4)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def msgspec_replace(struct, **changes):
    import msgspec

    return msgspec.structs.replace(struct, **changes)


def _threads_in_a_fresh_process(local_ranks: int, env: dict[str, str]) -> int:
    import subprocess
    import sys

    code = ("from tokenmill.distributed.mp import share_host_cores; "
            f"print(share_host_cores({local_ranks}, 0))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1])


def test_ranks_on_one_host_share_its_cores_as_threads():
    """torch starts a thread a core in every process: two ranks on this host take half the
    cores each (at least one), one rank keeps torch's default, and OMP_NUM_THREADS wins."""
    import torch

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    cores = len(os.sched_getaffinity(0))
    default = _threads_in_a_fresh_process(1, env)
    assert default == torch.get_num_threads()
    assert _threads_in_a_fresh_process(2, env) == min(default, max(1, cores // 2))
    assert _threads_in_a_fresh_process(cores * 4, env) == 1
    # set, it wins over the share (torch's default here is above a half of the cores)
    assert _threads_in_a_fresh_process(2, env | {"OMP_NUM_THREADS": str(default)}) == default
    # one rank of one of two data-parallel replicas on the host (`serve -dp 2`): a half
    assert _threads_in_a_fresh_process(1, env | {"TOKENMILL_HOST_REPLICAS": "2"}) == min(
        default, max(1, cores // 2))
    assert _threads_in_a_fresh_process(2, env | {"TOKENMILL_HOST_REPLICAS": "2"}) == min(
        default, max(1, cores // 4))


def _half_the_cores_or_skip(monkeypatch) -> tuple[int, int]:
    """(this host's cores, half of them): two processes' share each; skips where torch's
    default thread count is already no more than that (nothing to see)."""
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    share = max(1, cores // 2)
    if share >= torch.get_num_threads():
        pytest.skip(f"torch's default of {torch.get_num_threads()} threads is already at most "
                    f"half of this host's {cores} cores")
    return cores, share


def test_mp_workers_take_their_share_of_the_cores(tiny_dirs, capfd, monkeypatch):
    """The mp executor's workers call it: with two ranks on a host of two or more cores
    each worker logs its share (the log goes to the inherited stderr)."""

    cores, share = _half_the_cores_or_skip(monkeypatch)
    llm = _llm(tiny_dirs["llama"], "mp", tensor_parallel_size=2)
    try:
        got = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(got[0].outputs[0].token_ids) == 3
    finally:
        llm.engine.shutdown()
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert f"rank {rank}: {share} intra-op threads ({cores} cores shared by 2 ranks" in err


def test_data_parallel_engine_processes_take_their_share_of_the_cores(tiny_dirs, capfd,
                                                                       monkeypatch, caplog):
    """`serve -dp 2` runs an engine process per replica: each (its uni executor computes
    in it) takes half the cores, as two mp ranks do; before, both ran torch's thread a core
    (served dp2 of the default model measured 0.26x tp1's throughput on 2 cores)."""

    from tokenmill.engine.config import EngineArgs
    from tokenmill.frontend.async_engine import AsyncLLM

    cores, share = _half_the_cores_or_skip(monkeypatch)
    caplog.set_level(logging.INFO, logger="tokenmill")  # the engine processes log at it
    engine = AsyncLLM(EngineArgs(model=str(tiny_dirs["llama"]), platform="cpu", dtype="float32",
                                 num_kv_blocks=64, block_size=4, data_parallel_size=2),
                      engine_process=True)
    engine.shutdown()
    err = capfd.readouterr().err
    line = f"rank 0: {share} intra-op threads ({cores} cores shared by 2 ranks on this host"
    assert err.count(line) == 2, err[-3000:]
