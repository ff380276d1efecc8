"""Stateful property test of the tier stack (host slab, disk files, a real redis-server)
against a shadow model of what each tier should hold, in LRU order.

Rules: put, get, promote, demote, evict from one tier, corrupt one tier's copy in place,
kill the remote tier. Invariants after every rule: a get returns the exact bytes put or
nothing; every tier holds exactly the keys the model says; capacities hold; bytes
written and promoted per tier equal the model's count of unique objects it received.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from test_kv_tiers import LAYOUT, obj, staging

from tokenmill.kv_connector.directory import TierDirectory
from tokenmill.kv_connector.disk import DiskTier
from tokenmill.kv_connector.host import HostMemoryTier
from tokenmill.kv_connector.messages import WorkerReport
from tokenmill.kv_connector.objects import HEADER_BYTES, CorruptObjectError, decode
from tokenmill.kv_connector.redis_tier import RedisTier
from tokenmill.kv_connector.stack import TierStack

SIZE = LAYOUT.object_bytes
NUM_KEYS = 8
CAPACITY = {"host": 3, "disk": 4, "redis": None}  # in objects
OBJECTS = [obj(i) for i in range(NUM_KEYS)]
KEY_INDEX = {k: i for i, (k, _) in enumerate(OBJECTS)}
indices = st.integers(0, NUM_KEYS - 1)


def _header_padding() -> set[int]:
    """Offsets of the header's alignment bytes: flipping one leaves an object `decode`
    accepts with the right payload, so the corrupt rule (whose shadow then expects a
    refusal) leaves them alone."""
    key, data = OBJECTS[0]
    padding = set()
    for offset in range(HEADER_BYTES):
        raw = bytearray(data)
        raw[offset] ^= 0x5A
        try:
            payload = decode(key, bytes(raw))
        except CorruptObjectError:
            continue
        assert bytes(payload) == data[HEADER_BYTES:]
        padding.add(offset)
    return padding


HEADER_PADDING = _header_padding()
tier_names = st.sampled_from(["host", "disk", "redis"])


class ShadowTier:
    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.held: OrderedDict[int, bool] = OrderedDict()  # index -> corrupt, LRU first
        self.written = 0
        self.promoted = 0

    def insert(self, i: int, promoted: bool) -> None:
        if self.capacity is not None and len(self.held) >= self.capacity:
            self.held.popitem(last=False)
        self.held[i] = False
        if promoted:
            self.promoted += 1
        else:
            self.written += 1


def make_machine(server):
    class TierStackMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            if not server.alive:
                server.start()
            server.client().flushall()
            self.dir = Path(tempfile.mkdtemp())
            self.tiers = {
                "host": HostMemoryTier(staging(), CAPACITY["host"] * SIZE, SIZE),
                "disk": DiskTier(self.dir, CAPACITY["disk"] * SIZE),
                "redis": RedisTier(server.url, socket_timeout_s=0.5, retry_after_s=60),
            }
            self.stack = TierStack(list(self.tiers.values()))
            # the engine's mirror of a stack in a worker process, fed by its change log
            self.stack.record_changes()
            self.mirror = TierDirectory(self.stack.index(b"fingerprint", 4))
            self.shadow = {n: ShadowTier(c) for n, c in CAPACITY.items()}
            self.redis_alive = True

        def live(self) -> list[str]:
            return [n for n in ("host", "disk", "redis") if n != "redis" or self.redis_alive]

        @rule(i=indices)
        def put(self, i):
            self.stack.put(*OBJECTS[i])
            for n in self.live():
                if i not in self.shadow[n].held:
                    self.shadow[n].insert(i, promoted=False)

        def expect_get(self, i) -> tuple[bytes | None, str | None]:
            order = self.live()
            for pos, n in enumerate(order):
                sh = self.shadow[n]
                if i not in sh.held:
                    continue
                if sh.held[i]:  # corrupt: deleted, next tier
                    del sh.held[i]
                    continue
                sh.held.move_to_end(i)
                for upper in order[:pos]:
                    self.shadow[upper].insert(i, promoted=True)
                return OBJECTS[i][1][HEADER_BYTES:], n
            return None, None

        @rule(i=indices)
        def get(self, i):
            want, tier = self.expect_get(i)
            got = self.stack.get(OBJECTS[i][0])
            if want is None:
                assert got is None
            else:
                assert got is not None and bytes(got[0]) == want and got[1] == tier

        @rule(i=indices)
        def promote(self, i):
            want, _ = self.expect_get(i)
            assert self.stack.promote(OBJECTS[i][0]) == (want is not None)

        @rule(i=indices)
        def demote(self, i):
            order = self.live()
            expected = False
            for pos, n in enumerate(order):
                sh = self.shadow[n]
                if i not in sh.held:
                    continue
                if sh.held[i]:
                    del sh.held[i]
                    continue
                sh.held.move_to_end(i)
                for lower in order[pos + 1 :]:
                    if i not in self.shadow[lower].held:
                        self.shadow[lower].insert(i, promoted=False)
                if any(i in self.shadow[lo].held for lo in order[pos + 1 :]):
                    del sh.held[i]
                    expected = True
                break
            assert self.stack.demote(OBJECTS[i][0]) == expected

        @rule(name=tier_names, i=indices)
        def evict(self, name, i):
            if name not in self.live():
                return
            self.tiers[name].delete(OBJECTS[i][0])
            self.shadow[name].held.pop(i, None)

        @rule(name=tier_names, i=indices, offset=st.integers(0, SIZE - 1).filter(
            lambda o: o not in HEADER_PADDING))
        def corrupt(self, name, i, offset):
            if name not in self.live() or i not in self.shadow[name].held:
                return
            key = OBJECTS[i][0]
            if name == "host":
                self.tiers["host"].slot_view(key)[offset] ^= 0x5A
            elif name == "disk":
                path = self.tiers["disk"].file_for(key)
                raw = bytearray(path.read_bytes())
                raw[offset] ^= 0x5A
                path.write_bytes(bytes(raw))
            else:
                rkey = RedisTier.redis_key(key)
                client = server.client()
                raw = bytearray(client.get(rkey))
                raw[offset] ^= 0x5A
                client.set(rkey, bytes(raw))
            self.shadow[name].held[i] = True

        @rule()
        def kill_redis(self):
            server.kill()
            self.redis_alive = False

        @invariant()
        def tiers_match_the_shadow(self):
            for n in self.live():
                held = {KEY_INDEX[k] for k in self.tiers[n].keys()}
                assert held == set(self.shadow[n].held), n
                if n != "redis":
                    assert list(self.shadow[n].held) == [KEY_INDEX[k] for k in self.tiers[n].keys()]
                    assert self.tiers[n].used_bytes() <= self.tiers[n].capacity_bytes
            self.mirror.apply(WorkerReport(tier_changes=self.stack.take_changes()))
            for n in self.live():
                held = set(self.tiers[n].keys())
                if n == "redis":  # deletes out of the stack's sight: the mirror may hold more
                    assert held <= self.mirror.held(n)
                else:  # host and disk report every removal: an exact mirror
                    assert held == self.mirror.held(n), n
            for n, sh in self.shadow.items():
                assert self.stack.stats[n].bytes_written == sh.written * SIZE, n
                assert self.stack.stats[n].bytes_promoted == sh.promoted * SIZE, n

        def teardown(self):
            self.stack.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    return TierStackMachine


def test_tier_stack_against_shadow(redis_server):
    run_state_machine_as_test(
        make_machine(redis_server),
        settings=settings(max_examples=60, stateful_step_count=30, deadline=None),
    )
