"""The Responses store against a shadow model: a bounded LRU (puts and gets both count as
uses; the least recently used entry goes first)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.server.response_store import ResponseStore, StoredResponse

IDS = st.sampled_from([f"resp_{i}" for i in range(8)])


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.capacity = 3
        self.store = ResponseStore(self.capacity)
        self.shadow: list[tuple[str, int]] = []  # least recently used first
        self.evicted = 0
        self.version = 0

    def _touch(self, rid: str, value: int) -> None:
        self.shadow = [(k, v) for k, v in self.shadow if k != rid] + [(rid, value)]

    @rule(rid=IDS)
    def put(self, rid):
        self.version += 1
        self.store.put(rid, StoredResponse({"id": rid, "v": self.version}, []))
        self._touch(rid, self.version)
        while len(self.shadow) > self.capacity:
            self.shadow.pop(0)
            self.evicted += 1

    @rule(rid=IDS)
    def get(self, rid):
        got = self.store.get(rid)
        expected = dict(self.shadow).get(rid)
        if expected is None:
            assert got is None
        else:
            assert got.response["v"] == expected
            self._touch(rid, expected)

    @precondition(lambda self: self.shadow)
    @rule()
    def oldest_goes_next(self):
        oldest = self.shadow[0][0]
        for i in range(self.capacity):
            self.put(f"fresh_{self.version}_{i}")
        assert oldest not in self.store

    @invariant()
    def same_contents(self):
        assert len(self.store) == len(self.shadow) <= self.capacity
        assert all(k in self.store for k, _ in self.shadow)
        assert self.store.num_evicted == self.evicted


TestStore = StoreMachine.TestCase
TestStore.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="max_responses=0"):
        ResponseStore(0)
