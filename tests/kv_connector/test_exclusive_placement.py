"""Exclusive device/host placement, as a stateful property test with a shadow of where
every block is.

The real Scheduler, KVCacheManager (its BlockPool evicting by benefit), both connector
halves and the tiers (a 6-object host over a disk that keeps everything) run sessions
over small KV tensors with a stand-in forward pass (core's engine step, minus the model).
The device pool holds 16 blocks; sessions' histories outgrow it. The shadow is the set of
blocks ever computed; after every rule (the worker drained):

- exclusive: no block is both cached on the device and held by the host;
- capacities add: until the host first evicts (it is full), no block computed is
  missing from device + host (what the device evicted moved to the host);
- no lost block: every block computed is on disk (write-through), so every turn reuses
  exactly the leading run of its prompt's blocks computed before (from the device, the
  host or the disk), computing only the rest;
- loads never wrong: every page a turn reads holds the tokens it was computed from.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from test_saves_in_flight import BS, MAX_LEN, Harness, expected_hit

from tokenmill.kv.hashing import hash_blocks
from tokenmill.kv_connector.objects import object_key


class ExclusivePlacementMachine(RuleBasedStateMachine):
    @initialize(mirrored=st.booleans())
    def setup(self, mirrored: bool) -> None:
        self.h = Harness(mirrored, with_host=True)
        self.histories: dict[int, list[int]] = {}
        self.computed: set[bytes] = set()  # block hashes ever computed (the shadow)

    def teardown(self) -> None:
        if hasattr(self, "h"):
            self.h.close()

    def key(self, block_hash: bytes) -> bytes:
        return object_key(self.h.scheduler.connector.fingerprint, block_hash)

    @rule(session=st.integers(0, 3), new=st.lists(st.integers(1, 60), min_size=1, max_size=12))
    def turn(self, session: int, new: list[int]) -> None:
        history = self.histories.get(session, [])
        if len(history) + len(new) + 1 > MAX_LEN - 4:
            history = [200 + session]  # the session starts over (a new conversation)
        prompt = history + new
        expected = expected_hit(prompt, self.computed)
        request = self.h.run(prompt)  # checks every page it reads holds its tokens
        assert request.num_cached_tokens == expected, (
            f"turn of {len(prompt)} tokens reused {request.num_cached_tokens}; the tiers "
            f"and the device held {expected}")
        self.computed.update(hash_blocks(prompt, BS))
        self.histories[session] = prompt + [100 + sum(prompt) % 50]
        self.h.flush()

    @rule()
    def device_forgets(self) -> None:
        """Every cached block leaves the device (a sleep): all of them move to the host."""
        assert self.h.kv.reset_prefix_cache()
        self.h.flush()

    @invariant()
    def placement(self) -> None:
        if not hasattr(self, "h"):
            return
        pool = self.h.kv.pool
        device = {self.key(b.block_hash) for b in pool.blocks if b.block_hash is not None}
        host = set(self.h.stack.host.keys())
        assert not device & host, "a block is both on the device and in the host"
        computed = {self.key(h) for h in self.computed}
        if self.h.stack.host.num_evicted == 0:  # until the host drops one, nothing is lost
            assert computed <= device | host, "a block left the device without moving"
        assert computed <= set(self.h.stack.tier("disk").keys())


def test_exclusive_placement_state_machine():
    run_state_machine_as_test(
        ExclusivePlacementMachine,
        settings=settings(max_examples=25, stateful_step_count=20, deadline=None),
    )
