"""The "ray" executor on a real Ray cluster of two nodes on this machine (two raylets on
loopback, one CPU each, started once for the module and shared by every test).

Every kind of parallelism, alone and mixed, over Ray actors placed on both nodes gives
greedy tokens identical to one process (the in-process "uni" executor), on a tiny dense
(llama) and MoE (Qwen3-MoE) model:
- two ranks, one per node: tp2 and pp2 (with the seeded sampler's logprobs), dcp2, pcp2,
  sp (tp2 with sequence parallel), MoE tp2 (every expert's intermediate dim split) and
  TPxEP (tp2 with `enable_expert_parallel`: attention by heads, each expert whole on its
  rank);
- four ranks (half a CPU each, two per node): tp2 x pp2, tp2 x dcp2, and dp2 x tp2: two
  replicas behind `LLM`'s front, each with a Ray executor and placement group of its own.
The bytes each rank counted through its communicator say that the dimension ran (the
all-reduces of TP, the all-to-all of EP, the all-gathers of DCP and PCP, SP's
reduce-scatters in place of every all-reduce). A killed actor makes the engine unhealthy
and fails its requests with an error naming the rank, within seconds; under `serve -dp 2`
it ends its replica's engine process and the front, and the other replica stops cleanly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from tiny_models import make_tiny_model

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineArgs
from tokenmill.engine.llm_engine import EngineDeadError
from tokenmill.engine.request import RequestStatus
from tokenmill.frontend.async_engine import AsyncLLM

pytestmark = [
    pytest.mark.long,  # a Ray cluster on loopback per case: minutes
    pytest.mark.xdist_group("ray"),  # one Ray cluster per module: one xdist worker runs them all
]

PROMPTS = ["The quick brown fox", "Paris is the capital of France; Berlin is", "def main():"]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True,
                   logprobs=2),
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
_NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20}


@pytest.fixture(scope="module")
def cluster():
    """One Ray cluster for the module: a head and a second node, one CPU each, so that
    two one-CPU ranks must sit on different nodes (the multi-host path)."""
    # Ray resolves "127.0.0.1" in an address to the host's outward IP, which this sandbox
    # cannot reach; this (Ray's own switch, read when ray is imported) keeps loopback
    env = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    saved = os.environ.get(env)
    os.environ[env] = "0"
    import ray  # after the switch above, which Ray reads at import
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={**_NODE, "include_dashboard": False})
    cluster.add_node(**_NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    if saved is None:
        os.environ.pop(env)
    else:
        os.environ[env] = saved


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, platform="cpu", num_kv_blocks=64,
               max_num_batched_tokens=16, **kw)


def _outputs(llm: LLM):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs[1].outputs[0].logprobs


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def models(tiny_dirs, tmp_path_factory):
    """The tiny models by name: the session's dense ones and a Qwen3-MoE."""
    return {"llama": tiny_dirs["llama"],
            "qwen3_moe": make_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")}


@pytest.fixture(scope="module")
def reference(models):
    """model name -> one process's greedy tokens, computed on first use."""
    cache: dict[str, list[list[int]]] = {}

    def of(name: str) -> list[list[int]]:
        if name not in cache:
            llm = _llm(models[name])
            cache[name] = _greedy(llm)
            llm.engine.shutdown()
        return cache[name]

    return of


@pytest.fixture(scope="module")
def sampled_reference(models):
    llm = _llm(models["llama"])
    out = _outputs(llm)
    llm.engine.shutdown()
    return out


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2},
                                   {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_ray_matches_uni_with_seeded_sampling(cluster, models, sampled_reference, sizes):
    llm = _llm(models["llama"], distributed_executor_backend="ray", **sizes)
    try:
        executor = llm.engine.executor
        assert type(executor).__name__ == "RayExecutor"
        assert len(set(executor.node_ids)) == 2  # one rank per node
        assert os.getpid() not in executor.pids
        tokens, logprobs = _outputs(llm)
    finally:
        llm.engine.shutdown()
    assert tokens == sampled_reference[0]
    # the seeded row's logprobs: same tokens and ranks; values up to float32 rounding
    # (tensor parallel sums the partial products in another order)
    want = sampled_reference[1]
    assert len(logprobs) == len(want)
    for got, exp in zip(logprobs, want):
        assert {t: lp.rank for t, lp in got.items()} == {t: lp.rank for t, lp in exp.items()}
        assert all(abs(got[t].logprob - exp[t].logprob) < 1e-4 for t in exp)


# case id -> (model, engine arguments, {(dim, op): "ran" (> 0 on every rank) or "none"})
CASES = {
    "dcp2": ("llama", {"decode_context_parallel_size": 2}, {("dcp", "all_gather"): "ran"}),
    "pcp2": ("llama", {"prefill_context_parallel_size": 2}, {("pcp", "all_gather"): "ran"}),
    "sp-tp2": ("llama", {"tensor_parallel_size": 2, "enable_sequence_parallelism": True},
               {("tp", "reduce_scatter"): "ran", ("tp", "all_reduce"): "none"}),
    "moe-tp2": ("qwen3_moe", {"tensor_parallel_size": 2},
                {("tp", "all_reduce"): "ran", ("tp", "all_to_all_single"): "none"}),
    "moe-tp2xep": ("qwen3_moe", {"tensor_parallel_size": 2, "enable_expert_parallel": True},
                   {("tp", "all_to_all_single"): "ran"}),
    # four ranks, two per node
    "tp2xpp2": ("llama", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
                {("tp", "all_reduce"): "ran"}),
    "tp2xdcp2": ("llama", {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
                 {("tp", "all_reduce"): "ran", ("dcp", "all_gather"): "ran"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ray_matches_one_process_with_ranks_on_both_nodes(cluster, models, reference,
                                                          monkeypatch, case):
    name, sizes, counted = CASES[case]
    want = reference(name)
    world = (sizes.get("tensor_parallel_size", 1) * sizes.get("pipeline_parallel_size", 1)
             * sizes.get("decode_context_parallel_size", 1)
             * sizes.get("prefill_context_parallel_size", 1))
    if world > 2:  # two one-CPU nodes: half a CPU per rank, PACK fills each node with two
        monkeypatch.setenv("TOKENMILL_RAY_WORKER_CPUS", "0.5")
    llm = _llm(models[name], distributed_executor_backend="ray", **sizes)
    try:
        executor = llm.engine.executor
        assert type(executor).__name__ == "RayExecutor"
        assert len(executor.pids) == world and os.getpid() not in executor.pids
        assert len(set(executor.node_ids)) == 2
        got = _greedy(llm)
        rpc = executor.collective_rpc
        ops = {key: rpc("communicated_op_bytes", key) for key in counted}
    finally:
        llm.engine.shutdown()
    assert got == want
    for key, expect in counted.items():
        if expect == "ran":
            assert all(b > 0 for b in ops[key]), (key, ops[key])
        else:
            assert ops[key] == [0] * world, (key, ops[key])


def test_dp2_x_tp2_replicas_each_on_their_own_ray_executor(cluster, models, reference,
                                                           monkeypatch):
    """Data parallel over Ray: each replica is an engine core with a Ray executor (a
    placement group of its own in the shared cluster); the front routes in this process."""
    monkeypatch.setenv("TOKENMILL_RAY_WORKER_CPUS", "0.5")
    want = reference("llama")
    llm = _llm(models["llama"], distributed_executor_backend="ray", data_parallel_size=2,
               tensor_parallel_size=2)
    try:
        engine = llm.engine
        executors = [e.executor for e in engine.replicas]
        assert [type(x).__name__ for x in executors] == ["RayExecutor"] * 2
        pids = [pid for x in executors for pid in x.pids]
        assert len(set(pids)) == 4 and os.getpid() not in pids
        assert executors[0]._group.id != executors[1]._group.id
        got = _greedy(llm)
        # three different prompts, no shared prefix: both replicas took requests
        assert engine.router.stats.num_routed == 3
        assert [e.scheduler.kv.stats.queries > 0 for e in engine.replicas] == [True, True]
    finally:
        llm.engine.shutdown()
    assert got == want


def test_serve_dp2_engine_processes_share_the_ray_cluster(cluster, models, reference,
                                                         monkeypatch):
    """`tokenmill serve -dp 2` over Ray: each replica's engine process joins the cluster
    named by RAY_ADDRESS (Ray's own variable, inherited by the engine processes) and
    places its ranks there; the front in this process routes and streams. A killed
    actor ends the front; the other replica stops."""
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    from ray.util import placement_group_table

    def created() -> int:
        return sum(g["state"] == "CREATED" for g in placement_group_table().values())

    want = reference("llama")
    before = created()
    args = EngineArgs(model=str(models["llama"]), dtype="float32", block_size=4,
                      platform="cpu", num_kv_blocks=64, max_num_batched_tokens=16,
                      data_parallel_size=2, distributed_executor_backend="ray")
    llm = AsyncLLM(args, engine_process=True)

    async def generate(i: int, prompt: str) -> list[int]:
        final = None
        async for out in llm.generate(llm.tokenizer.encode(prompt), GREEDY, f"r{i}"):
            final = out
        return final.outputs[0].token_ids

    async def every_prompt() -> list[list[int]]:
        return list(await asyncio.gather(*(generate(i, p) for i, p in enumerate(PROMPTS))))

    llm.start()
    try:
        assert created() - before == 2  # a placement group per replica, in this cluster
        assert asyncio.run(every_prompt()) == want
        assert llm._client.router.stats.num_routed == 3
        assert llm.stats.prefix_cache_queries > 0
        # a killed actor ends its replica's engine process (it reports the dead rank),
        # which ends the front; the other replica is asked to stop and exits cleanly
        actors = _ray_worker_pids(cluster)
        assert len(actors) == 2, actors  # one rank per replica
        os.kill(actors[0], signal.SIGKILL)
        killed_at = time.monotonic()
        while not llm.is_dead:
            assert time.monotonic() - killed_at < 15, "the front did not notice"
            time.sleep(0.05)
        clients = llm._client.clients  # they reap their processes (see wait_exit)
        for client in clients:
            client.wait_exit(max(0.0, killed_at + 10 - time.monotonic()))
        # the failed one, the stopped one
        assert sorted(c.exitcode for c in clients) == [0, 1], [c.exitcode for c in clients]
        with pytest.raises(EngineDeadError):
            asyncio.run(generate(9, "late"))
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 10
    while created() != before:  # each replica removed its group on the way out
        assert time.monotonic() < deadline, placement_group_table()
        time.sleep(0.1)


def _ray_worker_pids(cluster) -> list[int]:
    """The live RayWorker actor processes of this cluster (Ray titles them; its raylets
    start them). Another test's cluster on this machine (pytest-xdist) is not counted."""
    from ray._private import ray_constants
    raylets = {info.process.pid for node in cluster.list_all_nodes()
               for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])}
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0]
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or it just ended
        state, parent = fields[0], int(fields[1])
        if title.startswith(b"ray::RayWorker") and state != b"Z" and parent in raylets:
            pids.append(int(entry))
    return sorted(pids)


def test_killed_ray_actor_fails_requests_cleanly(cluster, models):
    llm = _llm(models["llama"], distributed_executor_backend="ray", tensor_parallel_size=2)
    engine = llm.engine
    try:
        tok = llm.get_tokenizer()
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", tok.encode(prompt), params, prompt=prompt)
        engine.step()
        os.kill(engine.executor.pids[1], signal.SIGKILL)
        start = time.monotonic()
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0]
            assert time.monotonic() - start < 20, "the engine did not notice the dead actor"
        assert sorted(finished) == ["r0", "r1", "r2"]
        assert {o.finish_reason for o in finished.values()} == {
            RequestStatus.FINISHED_ERROR.value
        }
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            engine.add_request("late", tok.encode("hi"), params)
    finally:
        engine.shutdown()
