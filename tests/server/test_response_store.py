"""The Responses store against a shadow model: a bounded LRU by entries and by bytes (puts
and gets both count as uses; the least recently used entry goes first; an entry larger
than the whole byte budget is not stored)."""

from __future__ import annotations

import json

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.server.response_store import ResponseStore, StoredResponse

IDS = st.sampled_from([f"resp_{i}" for i in range(8)])
SIZES = st.integers(0, 260)


def json_size(response: dict, conversation: list) -> int:
    return len(json.dumps([response, conversation], separators=(",", ":")).encode())


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.capacity, self.max_bytes = 3, 300
        self.store = ResponseStore(self.capacity, self.max_bytes)
        self.shadow: list[tuple[str, int, int]] = []  # (id, version, bytes), LRU first
        self.evicted = 0
        self.version = 0

    def _touch(self, rid: str, value: int, size: int) -> None:
        self.shadow = [e for e in self.shadow if e[0] != rid] + [(rid, value, size)]

    @rule(rid=IDS, pad=SIZES)
    def put(self, rid, pad=0):
        self.version += 1
        response = {"id": rid, "v": self.version}
        conversation = [{"role": "user", "content": "x" * pad}]
        size = json_size(response, conversation)
        stored = self.store.put(rid, StoredResponse(response, conversation))
        assert stored == (size <= self.max_bytes)
        if not stored:
            return
        self._touch(rid, self.version, size)
        while len(self.shadow) > self.capacity or sum(e[2] for e in self.shadow) > self.max_bytes:
            self.shadow.pop(0)
            self.evicted += 1

    @rule(rid=IDS)
    def get(self, rid):
        got = self.store.get(rid)
        expected = {k: (v, b) for k, v, b in self.shadow}.get(rid)
        if expected is None:
            assert got is None
        else:
            assert got.response["v"] == expected[0]
            self._touch(rid, *expected)

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
        assert all(k in self.store for k, _, _ in self.shadow)
        assert self.store.num_bytes == sum(e[2] for e in self.shadow) <= self.max_bytes
        assert self.store.num_evicted == self.evicted


TestStore = StoreMachine.TestCase
TestStore.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="max_responses=0"):
        ResponseStore(0)
    with pytest.raises(ValueError, match="max_bytes=0"):
        ResponseStore(4, 0)
