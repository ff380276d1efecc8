"""Stateful property test of the tier stack (host slab, disk files, a real redis-server)
against a shadow model of what each tier should hold: the durable tiers (disk, redis)
in LRU order, the host by priority (clock + benefit, GreedyDual as the device pool).

Rules: put (a save: durable tiers only), get, promote (a prefetch into the host), move in
(a device eviction into the host, with its benefit), move out (a load from the host),
pin and unpin a host object, evict from one tier, corrupt one tier's copy in place,
kill the remote tier. Invariants after every rule: a get returns the exact bytes put or
nothing; every tier holds exactly the keys the model says (the host in eviction order);
pinned objects are never evicted; capacities hold; bytes written and promoted per tier
equal the model's count of objects it received; the mirror (directory.py) matches.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from test_kv_tiers import CODEC, LAYOUT, obj, staging

from tokenmill.kv_connector.directory import TierDirectory
from tokenmill.kv_connector.disk import DiskTier
from tokenmill.kv_connector.host import HostMemoryTier
from tokenmill.kv_connector.objects import HEADER_BYTES, CorruptObjectError
from tokenmill.kv_connector.redis_tier import RedisTier
from tokenmill.kv_connector.stack import TierStack
from tokenmill.platforms.kv_messages import WorkerReport

SIZE = LAYOUT.object_bytes
NUM_KEYS = 8
CAPACITY = {"host": 3, "disk": 4, "redis": None}  # in objects
OBJECTS = [obj(i) for i in range(NUM_KEYS)]
KEY_INDEX = {k: i for i, (k, _) in enumerate(OBJECTS)}
indices = st.integers(0, NUM_KEYS - 1)


def _header_padding() -> set[int]:
    """Offsets of header bytes whose flip `decode` would accept (with the right payload),
    which the corrupt rule (whose shadow then expects a refusal) would have to leave
    alone. Format 2 checks every header byte (reserved and tag bytes must be zero
    unless tagged), so this is empty; the assert below keeps it so."""
    key, data = OBJECTS[0]
    padding = set()
    for offset in range(HEADER_BYTES):
        raw = bytearray(data)
        raw[offset] ^= 0x5A
        try:
            payload = CODEC.decode(key, bytes(raw))
        except CorruptObjectError:
            continue
        assert bytes(payload) == data[HEADER_BYTES:]
        padding.add(offset)
    return padding


HEADER_PADDING = _header_padding()
assert not HEADER_PADDING, f"header bytes decode ignores: {sorted(HEADER_PADDING)}"
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


class ShadowHost:
    """The host by priority: clock + benefit at insertion (no benefit: the mean of what
    it holds), the lowest unpinned goes first, the clock rises to each eviction's
    priority; a pinned object deleted reads as gone at once and frees its slot at its
    last unpin. Integer benefits keep the float sums exact, as in the tier."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: dict[int, bool] = {}  # index -> corrupt
        self.priority: dict[int, tuple[float, int]] = {}  # index -> (priority, tick)
        self.benefit: dict[int, float] = {}
        self.pins: dict[int, int] = {}
        self.doomed: set[int] = set()
        self.clock = 0.0
        self.tick = 0
        self.written = self.promoted = 0

    def live(self) -> list[int]:
        return sorted((i for i in self.held if i not in self.doomed), key=lambda i: self.priority[i])

    def insert(self, i: int, benefit: float | None, promoted: bool) -> bool:
        if i in self.held:
            return False
        if len(self.held) >= self.capacity:
            victims = [j for j in sorted(self.held, key=lambda j: self.priority[j])
                       if not self.pins.get(j)]
            if not victims:
                return False
            self.clock = max(self.clock, self.priority[victims[0]][0])
            self.drop(victims[0])
        if benefit is None:
            benefit = sum(self.benefit.values()) / len(self.benefit) if self.benefit else 0.0
        self.held[i] = False
        self.benefit[i] = benefit
        self.priority[i] = (self.clock + benefit, self.tick)
        self.tick += 1
        if promoted:
            self.promoted += 1
        else:
            self.written += 1
        return True

    def drop(self, i: int) -> None:
        del self.held[i], self.priority[i], self.benefit[i]
        self.doomed.discard(i)

    def delete(self, i: int) -> None:
        if i not in self.held:
            return
        if self.pins.get(i):
            self.doomed.add(i)
        else:
            self.drop(i)


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
            self.stack = TierStack(list(self.tiers.values()), CODEC)
            # the engine's mirror of a stack in a worker process, fed by its change log
            self.stack.record_changes()
            self.mirror = TierDirectory(self.stack.index(b"fingerprint", 4))
            self.host = ShadowHost(CAPACITY["host"])
            self.shadow = {n: ShadowTier(c) for n, c in CAPACITY.items() if n != "host"}
            self.redis_alive = True

        def durable(self) -> list[str]:
            return [n for n in ("disk", "redis") if n != "redis" or self.redis_alive]

        @rule(i=indices)
        def put(self, i):
            self.stack.put(*OBJECTS[i])
            for n in self.durable():
                if i not in self.shadow[n].held:
                    self.shadow[n].insert(i, promoted=False)

        def expect_durable(self, i) -> tuple[bytes | None, str | None]:
            order = self.durable()
            for pos, n in enumerate(order):
                sh = self.shadow[n]
                if i not in sh.held:
                    continue
                if sh.held[i]:  # corrupt: deleted, next tier
                    del sh.held[i]
                    continue
                sh.held.move_to_end(i)
                for upper in order[:pos]:  # a remote hit is copied to disk
                    self.shadow[upper].insert(i, promoted=True)
                return OBJECTS[i][1][HEADER_BYTES:], n
            return None, None

        def expect_get(self, i) -> tuple[bytes | None, str | None]:
            h = self.host
            if i in h.held and i not in h.doomed:
                if not h.held[i]:
                    return OBJECTS[i][1][HEADER_BYTES:], "host"
                h.delete(i)  # corrupt: deleted, the durable tiers tried
            return self.expect_durable(i)

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
            h = self.host
            if i in h.held and i not in h.doomed:
                expected = True
            else:
                want, _ = self.expect_durable(i)
                expected = want is not None and h.insert(i, None, promoted=True)
            assert self.stack.promote(OBJECTS[i][0]) == expected

        @rule(i=indices, benefit=st.integers(0, 8))
        def move_in(self, i, benefit):
            """A device eviction: the block's object into the host, with its benefit."""
            if i in self.host.doomed:
                return  # still pinned by a reader after its move out: not re-inserted
            expected = self.host.insert(i, float(benefit), promoted=False)
            key, data = OBJECTS[i]
            assert self.tiers["host"].put(key, data, float(benefit)) == expected
            if expected:
                self.stack.log_held("host", [key])
                self.stack.count("host", bytes_written=SIZE)

        @rule(i=indices)
        def move_out(self, i):
            """A load took the block to the device: the host drops it."""
            self.host.delete(i)
            self.stack.delete(self.tiers["host"], OBJECTS[i][0])

        @rule(i=indices)
        def pin(self, i):
            self.host.pins[i] = self.host.pins.get(i, 0) + 1
            self.tiers["host"].pin([OBJECTS[i][0]])

        @rule(i=indices)
        def unpin(self, i):
            if not self.host.pins.get(i):
                return
            self.host.pins[i] -= 1
            if not self.host.pins[i]:
                del self.host.pins[i]
                if i in self.host.doomed:
                    self.host.drop(i)
            self.tiers["host"].unpin([OBJECTS[i][0]])

        @rule(name=tier_names, i=indices)
        def evict(self, name, i):
            if name == "host":
                self.move_out(i)
                return
            if name not in self.durable():
                return
            self.tiers[name].delete(OBJECTS[i][0])
            self.shadow[name].held.pop(i, None)

        @rule(name=tier_names, i=indices, offset=st.integers(0, SIZE - 1).filter(
            lambda o: o not in HEADER_PADDING))
        def corrupt(self, name, i, offset):
            key = OBJECTS[i][0]
            if name == "host":
                if i not in self.host.held or i in self.host.doomed:
                    return
                self.tiers["host"].slot_view(key)[offset] ^= 0x5A
                self.host.held[i] = True
                return
            if name not in self.durable() or i not in self.shadow[name].held:
                return
            if name == "disk":
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
            host = self.tiers["host"]
            assert [KEY_INDEX[k] for k in host.keys()] == self.host.live()
            assert host.used_bytes() == len(self.host.held) * SIZE <= host.capacity_bytes
            for n in self.durable():
                held = {KEY_INDEX[k] for k in self.tiers[n].keys()}
                assert held == set(self.shadow[n].held), n
                if n != "redis":
                    assert list(self.shadow[n].held) == [KEY_INDEX[k] for k in self.tiers[n].keys()]
                    assert self.tiers[n].used_bytes() <= self.tiers[n].capacity_bytes
            self.mirror.apply(WorkerReport(tier_changes=self.stack.take_changes()))
            for n in ("host", *self.durable()):
                held = set(self.tiers[n].keys())
                if n == "redis":  # deletes out of the stack's sight: the mirror may hold more
                    assert held <= self.mirror.held(n)
                else:  # host and disk report every removal: an exact mirror
                    assert held == self.mirror.held(n), n
            stats = self.stack.stats
            assert stats["host"].bytes_written == self.host.written * SIZE
            assert stats["host"].bytes_promoted == self.host.promoted * SIZE
            for n, sh in self.shadow.items():
                assert stats[n].bytes_written == sh.written * SIZE, n
                assert stats[n].bytes_promoted == sh.promoted * SIZE, n

        def teardown(self):
            self.stack.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    return TierStackMachine


def test_tier_stack_against_shadow(redis_server):
    run_state_machine_as_test(
        make_machine(redis_server),
        settings=settings(max_examples=60, stateful_step_count=30, deadline=None),
    )
