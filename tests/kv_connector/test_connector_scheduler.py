"""The connector's scheduler side inside the real Scheduler, with a real host tier and a
real worker over small KV tensors (no model): admission on an external hit, a request
that waits for its load, saves that are never issued twice, and a request aborted while
its load is in flight (its blocks stay allocated until the load reports)."""

from __future__ import annotations

import tempfile
import threading

import torch
from test_kv_tiers import staging

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv_connector.disk import DiskTier
from tokenmill.kv_connector.host import HostMemoryTier
from tokenmill.kv_connector.objects import KVLayout, ObjectCodec
from tokenmill.kv_connector.scheduler_side import KVConnectorScheduler
from tokenmill.kv_connector.stack import TierStack
from tokenmill.kv_connector.worker import KVConnectorWorker
from tokenmill.sampling_params import SamplingParams

BS, NUM_BLOCKS = 4, 16
LAYOUT = KVLayout("m", "float32", BS, ((2, BS, 1, 2),) * 2, 4)
CODEC = ObjectCodec(LAYOUT.payload_bytes)


def host_and_disk() -> TierStack:
    """A host tier over a disk tier: saves go to disk, evicted blocks move to the host."""
    host = HostMemoryTier(staging(), 64 * LAYOUT.object_bytes, LAYOUT.object_bytes)
    return TierStack([host, DiskTier(tempfile.mkdtemp(), 1 << 24)], CODEC)


def setup():
    kv = KVCacheManager(NUM_BLOCKS, BS)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    stack = host_and_disk()
    scheduler.connector = KVConnectorScheduler(stack, LAYOUT.fingerprint(), BS)
    worker = KVConnectorWorker(stack, LAYOUT)
    caches = [torch.zeros(2, NUM_BLOCKS, BS, 1, 2) for _ in range(2)]
    worker.register_kv_caches(caches)
    return scheduler, worker, caches


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=4))


def run_step(scheduler, worker, caches, wait: bool = True):
    """What the runner does with a step's connector part; computing a token writes a
    value derived from it into every layer (a stand-in forward pass)."""
    plan = scheduler.schedule()
    if plan.step is None or plan.step.kv_connector is None:
        return plan  # an empty step: not run
    meta = plan.step.kv_connector
    worker.begin_step(meta)
    for s in plan.scheduled:
        for i, tok in enumerate(s.token_ids):
            pos = s.start_position + i
            for c in caches:
                c[:, s.block_ids[pos // BS], pos % BS] = float(tok)
    worker.end_step(meta)
    scheduler.update_computed(plan)
    if wait:
        scheduler.update_from_connector(worker.drain())
    return plan


def test_external_hit_loads_then_computes_only_the_rest():
    scheduler, worker, caches = setup()
    prompt = list(range(10, 30))  # 20 tokens: 5 blocks
    scheduler.add_request(request("a", prompt))
    plan = run_step(scheduler, worker, caches)
    assert len(plan.step.kv_connector.saves) == 5
    scheduler.finish("a", RequestStatus.FINISHED_STOPPED)
    scheduler.kv.pool.reset_prefix_cache()  # the device forgets it: its blocks move to host
    plan = run_step(scheduler, worker, caches)  # a step with nothing to compute carries them
    assert len(plan.step.kv_connector.demotes) == 5 and len(worker.stack.host.keys()) == 5
    for c in caches:
        c.zero_()
    scheduler.add_request(request("b", prompt + [99, 98]))
    plan = run_step(scheduler, worker, caches)  # admission: a load, nothing computed
    assert plan.scheduled == [] and len(plan.step.kv_connector.loads[0].blocks) == 5
    assert worker.stack.host.keys() == []  # moved back to the device
    assert scheduler.requests["b"].status is RequestStatus.RUNNING
    assert scheduler.requests["b"].num_computed_tokens == 20
    plan = run_step(scheduler, worker, caches)
    (s,) = plan.scheduled
    assert (s.start_position, s.token_ids) == (20, [99, 98])
    for pos, tok in enumerate(prompt):  # the loaded pages hold what "a" computed
        assert caches[1][0, s.block_ids[pos // BS], pos % BS, 0, 0] == tok
    assert plan.step.kv_connector.saves == []  # the loaded blocks are not saved again


def test_a_block_being_saved_is_not_saved_twice():
    scheduler, worker, caches = setup()
    prompt = list(range(40, 52))
    scheduler.add_request(request("a", prompt))
    scheduler.add_request(request("b", prompt))  # same prefix, same step
    plan = run_step(scheduler, worker, caches, wait=False)
    keys = [t.key for t in plan.step.kv_connector.saves]
    assert len(keys) == len(set(keys))
    worker.drain()


def test_abort_while_loading_keeps_blocks_until_the_load_reports():
    scheduler, worker, caches = setup()
    prompt = list(range(60, 80))
    scheduler.add_request(request("a", prompt))
    run_step(scheduler, worker, caches)
    scheduler.finish("a", RequestStatus.FINISHED_STOPPED)
    scheduler.kv.pool.reset_prefix_cache()
    scheduler.add_request(request("b", prompt))
    plan = scheduler.schedule()  # the load is handed to the worker with this step
    assert plan.step.kv_connector.loads and scheduler.requests["b"].status is RequestStatus.WAITING_FOR_KV
    held = NUM_BLOCKS - scheduler.kv.pool.num_free_blocks
    scheduler.finish("b", RequestStatus.FINISHED_ABORTED)
    assert "b" in scheduler.parked and scheduler.has_unfinished_requests()
    assert NUM_BLOCKS - scheduler.kv.pool.num_free_blocks == held  # not reusable yet
    worker.begin_step(plan.step.kv_connector)
    scheduler.update_from_connector(worker.drain())
    assert not scheduler.parked and not scheduler.has_unfinished_requests()
    assert scheduler.kv.pool.num_free_blocks == NUM_BLOCKS


def test_abort_before_the_load_is_sent_frees_at_once():
    scheduler, worker, caches = setup()
    prompt = list(range(60, 80))
    scheduler.add_request(request("a", prompt))
    run_step(scheduler, worker, caches)
    scheduler.finish("a", RequestStatus.FINISHED_STOPPED)
    scheduler.kv.pool.reset_prefix_cache()
    scheduler.add_request(request("b", prompt))
    # admitted (blocks allocated, load queued) but finished before a step sends the load
    req = scheduler.requests["b"]
    hits, num_hit = scheduler.kv.find_cached_prefix(req)
    assert num_hit == 0  # the prefix cache was reset: every block comes from a tier
    assert scheduler._start_external_load(req, hits, num_hit)
    scheduler.finish("b", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.parked and scheduler.kv.pool.num_free_blocks == NUM_BLOCKS


class SlowDiskTier(DiskTier):
    """A disk tier whose writes wait for `release`: the save thread of a busy machine."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.release = threading.Event()

    def put(self, key, data):
        assert self.release.wait(30), "the test never released the slow tier"
        return super().put(key, data)


def test_a_block_whose_save_is_in_flight_is_loaded_not_recomputed():
    """The device evicts a finished request's blocks while their saves still wait on the
    worker thread: the next request's lookup counts them (the save runs before the load on
    the one thread), so it loads the whole prefix and computes only its new tokens."""
    kv = KVCacheManager(NUM_BLOCKS, BS)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    tier = SlowDiskTier(tempfile.mkdtemp(), 1 << 24)
    stack = TierStack([tier], CODEC)
    scheduler.connector = KVConnectorScheduler(stack, LAYOUT.fingerprint(), BS)
    worker = KVConnectorWorker(stack, LAYOUT)
    caches = [torch.zeros(2, NUM_BLOCKS, BS, 1, 2) for _ in range(2)]
    worker.register_kv_caches(caches)
    prompt = list(range(10, 30))  # 5 blocks
    scheduler.add_request(request("a", prompt))
    plan = run_step(scheduler, worker, caches, wait=False)
    assert len(plan.step.kv_connector.saves) == 5
    scheduler.finish("a", RequestStatus.FINISHED_STOPPED)
    scheduler.kv.pool.reset_prefix_cache()
    for c in caches:
        c.zero_()
    assert not any(stack.locate([t.key for t in plan.step.kv_connector.saves]))
    scheduler.add_request(request("b", prompt + [99, 98]))
    plan = scheduler.schedule()
    (job,) = plan.step.kv_connector.loads
    assert len(job.blocks) == 5  # every block, though no tier holds one yet
    worker.begin_step(plan.step.kv_connector)
    tier.release.set()
    scheduler.update_computed(plan)
    scheduler.update_from_connector(worker.drain())
    assert scheduler.requests["b"].num_computed_tokens == 20
    plan = run_step(scheduler, worker, caches)
    (s,) = plan.scheduled
    assert (s.start_position, s.token_ids) == (20, [99, 98])
    for pos, tok in enumerate(prompt):  # the pages the delayed saves wrote, loaded
        assert caches[1][0, s.block_ids[pos // BS], pos % BS, 0, 0] == tok
    assert stack.stats[tier.name].tokens_recomputed == 0


def test_a_load_that_does_not_fit_yet_waits_instead_of_recomputing():
    """A tier holds the prompt but the pool is held by a running request: the new turn
    waits for blocks (as a prompt that does not fit does) instead of starting a chunk that
    would compute what the tier holds; once blocks free up it loads and computes only its
    new tokens."""
    kv = KVCacheManager(NUM_BLOCKS, BS)
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64,
                             long_prefill_token_threshold=BS)
    scheduler = Scheduler(config, kv)
    stack = host_and_disk()
    scheduler.connector = KVConnectorScheduler(stack, LAYOUT.fingerprint(), BS)
    worker = KVConnectorWorker(stack, LAYOUT)
    caches = [torch.zeros(2, NUM_BLOCKS, BS, 1, 2) for _ in range(2)]
    worker.register_kv_caches(caches)
    prompt = list(range(10, 30))  # 5 blocks, saved to the disk tier
    scheduler.add_request(request("a", prompt))
    while scheduler.requests["a"].num_computed_tokens < len(prompt):
        run_step(scheduler, worker, caches)
    scheduler.finish("a", RequestStatus.FINISHED_STOPPED)
    scheduler.kv.pool.reset_prefix_cache()
    hog = list(range(100, 148))  # 12 blocks of the 16: 4 stay free, the load needs 5
    scheduler.add_request(request("hog", hog))
    while scheduler.requests["hog"].num_computed_tokens < len(hog):
        run_step(scheduler, worker, caches)
    scheduler.add_request(request("b", prompt + [99, 98]))
    plan = run_step(scheduler, worker, caches)
    # no room for the load: b waits (before, it started a one-block chunk from token 0)
    assert plan.step.kv_connector is None or not plan.step.kv_connector.loads
    assert scheduler.requests["b"].status is RequestStatus.WAITING
    assert scheduler.requests["b"].num_computed_tokens == 0 and not plan.scheduled
    scheduler.finish("hog", RequestStatus.FINISHED_STOPPED)
    plan = run_step(scheduler, worker, caches)
    (job,) = plan.step.kv_connector.loads
    assert len(job.blocks) == 5
    assert scheduler.requests["b"].num_computed_tokens == 20
    plan = run_step(scheduler, worker, caches)
    (s,) = plan.scheduled
    assert (s.start_position, s.token_ids) == (20, [99, 98])
