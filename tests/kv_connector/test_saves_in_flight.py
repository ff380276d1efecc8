"""A block whose save is still in flight when a later turn of its session arrives.

The race behind the once-in-three recompute of the trace replay: a turn ends, the worker's
background thread is still writing its last blocks to the tiers, the device evicts them
(another session's turn), and the session's next turn is looked up. The tiers do not hold
those blocks yet; the scheduler side must count them anyway (the worker runs its jobs in
the order sent, so the load queues behind the save) instead of recomputing them.

Here the slowness is made deterministic: the disk tier's writes (saves go to the durable
tiers; the host holds what the device evicts) wait behind a gate the test opens and
closes (as on a loaded machine, where the steps outrun the writer thread).
The real Scheduler, connector halves and tiers (host over disk) run over small KV tensors
with a stand-in forward pass; the engine's mirror of a worker process's stack
(TierDirectory, "mp") is driven from the same reports, as the engine drives it.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)
from test_kv_tiers import staging

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.kv.hashing import hash_blocks
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv_connector.directory import TierDirectory
from tokenmill.kv_connector.disk import DiskTier
from tokenmill.kv_connector.host import HostMemoryTier
from tokenmill.kv_connector.objects import KVLayout, ObjectCodec
from tokenmill.kv_connector.scheduler_side import KVConnectorScheduler
from tokenmill.kv_connector.stack import TierStack
from tokenmill.kv_connector.worker import KVConnectorWorker
from tokenmill.sampling_params import SamplingParams

BS, NUM_BLOCKS, MAX_LEN = 4, 16, 64
LAYOUT = KVLayout("m", "float32", BS, ((2, BS, 1, 2),) * 2, 4)
HOST_OBJECTS = 6  # the host tier evicts: older blocks come back from disk


class GatedDiskTier(DiskTier):
    """The disk tier, its writes held while `gate` is closed (a writer slower than the
    steps). Reads are not gated; the worker's one thread queues them behind the writes."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.gate = threading.Event()
        self.gate.set()

    def put(self, key, data) -> bool:
        if not self.gate.wait(timeout=30):
            raise RuntimeError("the test left the disk tier's gate closed for 30 s")
        return super().put(key, data)


class Harness:
    """One engine's connector over a 16-block device pool; `mirrored`: the scheduler side
    asks a TierDirectory fed by the worker's reports ("mp"), else the stack itself."""

    def __init__(self, mirrored: bool, with_host: bool = True) -> None:
        self.dir = Path(tempfile.mkdtemp())
        host = HostMemoryTier(staging(), HOST_OBJECTS * LAYOUT.object_bytes, LAYOUT.object_bytes)
        self.disk = GatedDiskTier(self.dir, 1 << 24)
        tiers = [host, self.disk] if with_host else [self.disk]
        self.stack = TierStack(tiers, ObjectCodec(LAYOUT.payload_bytes))
        self.worker = KVConnectorWorker(self.stack, LAYOUT)
        self.caches = [torch.zeros(2, NUM_BLOCKS, BS, 1, 2) for _ in range(2)]
        self.worker.register_kv_caches(self.caches)
        view: TierStack | TierDirectory = self.stack
        if mirrored:
            self.stack.record_changes()
            self.worker.mirrored = True
            view = TierDirectory(self.stack.index(LAYOUT.fingerprint(), BS))
        self.kv = KVCacheManager(NUM_BLOCKS, BS)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=64, max_model_len=MAX_LEN), self.kv
        )
        self.scheduler.connector = KVConnectorScheduler(view, LAYOUT.fingerprint(), BS)
        self._ids = 0

    def run(self, prompt: list[int]) -> Request:
        """Run one request of one output token to its end, as the engine steps it; the
        stand-in forward pass writes each token's value into its slot of every layer and
        checks, when it samples, that every earlier position holds its token (a loaded
        page included)."""
        self._ids += 1
        request = Request(str(self._ids), prompt, SamplingParams(temperature=0, max_tokens=1))
        self.scheduler.add_request(request)
        for _ in range(1000):
            plan = self.scheduler.schedule()
            if plan.step is not None:
                meta = plan.step.kv_connector
                self.worker.begin_step(meta)
                for s in plan.scheduled:
                    for i, tok in enumerate(s.token_ids):
                        pos = s.start_position + i
                        for c in self.caches:
                            c[:, s.block_ids[pos // BS], pos % BS] = float(tok)
                self.worker.end_step(meta)
                self.scheduler.update_computed(plan)
            # the worker's report with the step's result; an idle step waits a little
            report = self.worker.report(wait_s=0.0 if plan.scheduled else 0.005)
            self.scheduler.update_from_connector(report)
            if any(s.sample for s in plan.scheduled):
                (s,) = plan.scheduled
                held = [self.caches[1][0, s.block_ids[p // BS], p % BS, 0, 0].item()
                        for p in range(len(prompt))]
                assert held == [float(t) for t in prompt], "a page holds another token's KV"
                self.scheduler.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
                return request
            if not plan.scheduled and self.scheduler.loading and not self.disk.gate.is_set():
                self.disk.gate.set()  # time passes: the slow writes (and the load) finish
        raise AssertionError(f"request {request.request_id} did not finish in 1000 steps")

    def flush(self) -> None:
        """Run the steps that carry what waits to be sent (evicted blocks to move) and
        apply the worker's report once it is done."""
        while self.scheduler.connector.has_unsent_saves:
            plan = self.scheduler.schedule()
            self.worker.begin_step(plan.step.kv_connector)
            self.worker.end_step(plan.step.kv_connector)
        self.scheduler.update_from_connector(self.worker.drain())

    def close(self) -> None:
        self.disk.gate.set()
        self.worker.drain()
        self.worker.close()
        self.stack.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def expected_hit(prompt: list[int], saved: set[bytes]) -> int:
    """Tokens a turn should not compute: its leading blocks some earlier turn computed
    (their saves issued: held, or about to be), leaving one token to compute."""
    n = 0
    for h in hash_blocks(prompt, BS)[: (len(prompt) - 1) // BS]:
        if h not in saved:
            break
        n += 1
    return n * BS


def test_a_turn_after_a_save_still_in_flight_loads_it_instead_of_recomputing():
    for mirrored, with_host in ((False, False), (True, False), (False, True), (True, True)):
        # without a host the blocks come only through the saves in flight; with one the
        # device's reset moves them there first
        h = Harness(mirrored, with_host)
        try:
            first = list(range(10, 34))  # 24 tokens: 6 blocks
            h.disk.gate.clear()  # the writer falls behind: first's saves stay queued
            h.run(first)
            h.kv.reset_prefix_cache()  # the device forgets it (another session's turn)
            second = h.run(first + [99, 7, 8])
            # all 6 blocks loaded (behind their saves), 3 tokens computed: not 24 + 3
            assert second.num_cached_tokens == 24, (mirrored, second.num_cached_tokens)
            stats = h.scheduler.connector.stack.snapshot()  # the mirror's, under "mp"
            assert all(s.tokens_recomputed == 0 for s in stats.values())
            loaded_from = {n: s.tokens_loaded for n, s in stats.items()}
            assert loaded_from == ({"host": 24, "disk": 0} if with_host else {"disk": 24})
        finally:
            h.close()


class SavesInFlightMachine(RuleBasedStateMachine):
    """Sessions take turns on a device pool that holds about one of them, while the
    host tier's writer is held back and let go at random. Shadow model: the blocks whose
    saves were issued (every block a turn computed; the disk tier never evicts here).
    Every turn must reuse exactly the leading run of its prompt's blocks the model holds
    (from the device or a tier), and every page it reads must hold the right tokens."""

    @initialize(mirrored=st.booleans(), with_host=st.booleans())
    def setup(self, mirrored: bool, with_host: bool) -> None:
        self.h = Harness(mirrored, with_host)
        self.histories: dict[int, list[int]] = {}
        self.saved: set[bytes] = set()

    def teardown(self) -> None:
        if hasattr(self, "h"):
            self.h.close()

    @rule(session=st.integers(0, 2), new=st.lists(st.integers(1, 60), min_size=1, max_size=10))
    def turn(self, session: int, new: list[int]) -> None:
        history = self.histories.get(session, [])
        if len(history) + len(new) + 1 > MAX_LEN - 4:
            history = [200 + session]  # the session starts over (a new conversation)
        prompt = history + new
        expected = expected_hit(prompt, self.saved)
        request = self.h.run(prompt)
        assert request.num_cached_tokens == expected, (
            f"turn of {len(prompt)} tokens reused {request.num_cached_tokens}, "
            f"{expected} were computed before"
        )
        self.saved.update(hash_blocks(prompt, BS))
        self.histories[session] = prompt + [100 + sum(prompt) % 50]  # its sampled token

    @rule()
    def writer_falls_behind(self) -> None:
        self.h.disk.gate.clear()

    @rule()
    def writer_catches_up(self) -> None:
        self.h.disk.gate.set()

    @rule()
    def device_forgets(self) -> None:
        self.h.kv.reset_prefix_cache()


def test_saves_in_flight_state_machine():
    run_state_machine_as_test(
        SavesInFlightMachine,
        settings=settings(max_examples=30, stateful_step_count=25, deadline=None),
    )
