"""The KV arena with recurrent state under random admit / extend / finish / evict /
preempt sequences, against a shadow model: two Gated DeltaNet groups (states of 3 pages,
checkpoints every 2 blocks, at the prompt end and rolling), a full-attention group and a
sliding window, all drawing from one pool.

The shadow knows what every page holds once a step has "run": an attention block the
token ids of its block, a recurrent slot or checkpoint the state after which tokens (as
the token prefix itself). After every step: reference counts equal the references the
allocators hold; no page is in two places unless it is one cached block or checkpoint
shared by readers; nothing leaks (free + held = usable); the per-group counts are exact;
every running request has one slot per recurrent group; and every prefix-cache hit
restores a checkpoint holding the state at exactly the hit boundary.

KV offload's paths too: a load from a tier (`allocate_slots(..., publish=False)`: the
blocks after the device hit and fresh pages for the checkpoint at the load's end, no
slot) that reports (published, the first step restores from it) or fails (given back),
and a finished request's rolling checkpoint held until its save is released: its pages
are never handed out meanwhile and keep the state they hold.

Eviction is "benefit" (and "lru" in a shorter run): every eviction is checked against a
brute-force scan (no cached page taken while an uncached one is free, none of higher
priority than a cached one left), and every request that frees its KV leaves its
prefix's pages scored as the shadow computes them from the stated score
(tests/kv_eviction_shadow.py).
"""

from __future__ import annotations

import random

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_eviction_shadow import free_and_check_scores, install_checked_pool

from tokenmill.engine.request import Request
from tokenmill.kv.block_pool import NULL_BLOCK
from tokenmill.kv.eviction import RecomputeCost
from tokenmill.kv.groups import plan_groups
from tokenmill.kv.manager import KVCacheManager, PrefixHit
from tokenmill.kv.recurrent import CheckpointPolicy, RecurrentStateAllocator
from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill.platforms.ops.linear_attention import gated_delta_state_spec
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 120
STATE = gated_delta_state_spec(24, 4, 2, 8, 4, torch.float32)  # 576 bytes: 3 pages of 256
SPECS = [
    AttentionSpec(AttentionKind.LINEAR, 2, 1, 8, torch.float32, BLOCK, state=STATE),
    AttentionSpec(AttentionKind.FULL, 2, 1, 8, torch.float32, BLOCK),
    AttentionSpec(AttentionKind.LINEAR, 2, 1, 8, torch.float32, BLOCK, state=STATE),
    AttentionSpec(AttentionKind.SLIDING_WINDOW, 2, 1, 8, torch.float32, BLOCK, 6),
]
LAYOUT = plan_groups(SPECS)  # gcd(2, 1, 1) = 1: linear, linear, full, window
PREFIXES = [[7] * 13, list(range(20)), [3, 1, 4, 1, 5, 9, 2, 6] * 2]


class RecurrentArena(RuleBasedStateMachine):
    eviction = "benefit"
    num_evictions = 0  # over every run: the pool must come under pressure

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, True, LAYOUT.groups, CheckpointPolicy(2),
                                 eviction=self.eviction,
                                 recompute_cost=RecomputeCost.from_specs(SPECS))
        self.pool = install_checked_pool(self.kv)
        self.recurrent = self.kv.recurrent_group_ids
        self.running: dict[str, Request] = {}
        self.preempted: list[Request] = []
        self.ids = 0
        self.loading: dict[str, tuple[Request, int]] = {}  # tier loads in flight: their end
        self.held: list[tuple[list, list]] = []  # held rolling checkpoints: pages, states
        self.content: dict[int, tuple] = {}  # block id -> what it holds (see module doc)
        self.rng = random.Random(0)

    # ---- the shadow ----------------------------------------------------------------
    def _state(self, g: int, request: Request, n: int) -> tuple:
        return ("state", g, tuple(request.all_token_ids[:n]))

    def _check_hit(self, request: Request, hit: PrefixHit, n: int) -> None:
        assert n % BLOCK == 0 and n < max(request.num_tokens, 1)
        for g, table in enumerate(hit.tables):
            if g in self.recurrent:
                if n:
                    assert len(table) == LAYOUT.groups[g].state_pages
                    for block in table:  # the checkpoint is the state at the boundary
                        assert self.content.get(block.block_id) == self._state(g, request, n)
                continue
            for j, block in enumerate(table):
                if block is not NULL_BLOCK:
                    tokens = tuple(request.all_token_ids[j * BLOCK : (j + 1) * BLOCK])
                    assert self.content.get(block.block_id) == ("kv", g, tokens)

    def _run_step(self, request: Request, start: int, end: int) -> None:
        """The step computed tokens [start, end): record what its pages now hold."""
        for g, alloc in enumerate(self.kv.allocators):
            if g in self.recurrent:
                restore, checkpoints = alloc.step_ops(request)
                for block_id in restore:  # read: the state at `start`
                    assert self.content.get(block_id) == self._state(g, request, start)
                for t, ids in checkpoints:
                    assert start < t <= end and t % BLOCK == 0
                    for block_id in ids:
                        self.content[block_id] = self._state(g, request, t)
                for block_id in alloc.block_ids(request):
                    self.content[block_id] = self._state(g, request, end)
                continue
            for j, block in enumerate(alloc.req_to_blocks.get(request.request_id, [])):
                if block is not NULL_BLOCK and (j + 1) * BLOCK <= end:
                    tokens = tuple(request.all_token_ids[j * BLOCK : (j + 1) * BLOCK])
                    self.content[block.block_id] = ("kv", g, tokens)

    def _grow(self, request: Request, n: int) -> None:
        start = request.num_computed_tokens
        if self.kv.allocate_slots(request, n):
            request.num_computed_tokens += n
            self._run_step(request, start, start + n)

    def _admit(self, request: Request, chunk: int) -> None:
        hit, n = self.kv.find_cached_prefix(request)
        self._check_hit(request, hit, n)
        num_new = min(chunk, request.num_tokens - n)
        free_before = self.kv.pool.num_free_blocks
        if self.kv.allocate_slots(request, num_new, hit):
            request.num_computed_tokens = n + num_new
            self.running[request.request_id] = request
            self._run_step(request, n, n + num_new)
        else:
            assert self.kv.pool.num_free_blocks == free_before
            assert self.kv.num_blocks_held(request) == [0] * self.kv.num_groups
            self.preempted.append(request)

    # ---- rules -------------------------------------------------------------------
    @rule(prefix=st.sampled_from(range(len(PREFIXES))), tail=st.integers(0, 20),
          chunk=st.integers(1, 30))
    def admit(self, prefix: int, tail: int, chunk: int) -> None:
        self.ids += 1
        tokens = PREFIXES[prefix] + [self.rng.randrange(50) for _ in range(tail)]
        self._admit(Request(f"r{self.ids}", tokens, SamplingParams(max_tokens=8)), chunk)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.integers(1, 10))
    def extend(self, data, n: int) -> None:
        """A prompt chunk, or a decode step (which appends the sampled token first)."""
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(self.rng.randrange(50))
            n = 1
        self._grow(request, min(n, request.num_tokens - request.num_computed_tokens))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), hold=st.booleans())
    def finish(self, data, hold: bool) -> None:
        request = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        if hold:  # KV offload: the rolling checkpoint stays held until its save reports
            pages = self.kv.hold_rolling_checkpoints(request)
            self.held.append((pages, [self.content.get(b.block_id) for b in pages]))
        self._free(request)

    @precondition(lambda self: self.held)
    @rule()
    def release(self) -> None:
        pages, _ = self.held.pop(0)
        self.kv.release(pages)

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), tail=st.integers(0, 20),
          blocks=st.integers(1, 6))
    def load(self, prefix: int, tail: int, blocks: int) -> None:
        """Admit through a tier load of up to `blocks` blocks after the device hit."""
        self.ids += 1
        tokens = PREFIXES[prefix] + [self.rng.randrange(50) for _ in range(tail)]
        request = Request(f"l{self.ids}", tokens, SamplingParams(max_tokens=8))
        hit, n = self.kv.find_cached_prefix(request)
        self._check_hit(request, hit, n)
        end = min(n + blocks * BLOCK, (request.num_tokens - 1) // BLOCK * BLOCK)
        if end <= n:
            return
        # as the scheduler does: a window needs no block before the one it reads at `end`
        padded = PrefixHit(n, [
            table + [NULL_BLOCK] * (alloc.first_needed_block(end) - len(table))
            for alloc, table in zip(self.kv.allocators, hit.tables, strict=True)
        ])
        if self.kv.allocate_slots(request, end - n, padded, publish=False):
            request.num_computed_tokens = n
            self.loading[request.request_id] = (request, end)
            tables = self.kv.load_block_ids(request)
            for g in self.recurrent:
                assert len(tables[g]) == LAYOUT.groups[g].state_pages
                assert self.kv.allocators[g].block_ids(request) == []  # no slot yet

    @precondition(lambda self: self.loading)
    @rule(data=st.data(), ok=st.booleans())
    def load_reports(self, data, ok: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.loading)))
        request, end = self.loading.pop(rid)
        if not ok:  # its blocks go back; it never ran
            self.kv.free(request)
            return
        tables = self.kv.load_block_ids(request)
        for g, ids in enumerate(tables):  # what the tier brought into them
            if g in self.recurrent:
                for block_id in ids:
                    self.content[block_id] = self._state(g, request, end)
                continue
            for j in range(request.num_computed_tokens // BLOCK, end // BLOCK):
                if ids[j] != NULL_BLOCK.block_id:
                    tokens = tuple(request.all_token_ids[j * BLOCK : (j + 1) * BLOCK])
                    self.content[ids[j]] = ("kv", g, tokens)
        self.kv.cache_blocks(request, end)
        request.num_computed_tokens = end
        start = end
        if self.kv.allocate_slots(request, 1):  # the first step restores from the checkpoint
            request.num_computed_tokens += 1
            self.running[rid] = request
            self._run_step(request, start, start + 1)
        else:  # no room for its slot: preempted
            self.kv.free(request)
            request.num_computed_tokens = 0
            self.preempted.append(request)

    def _free(self, request: Request) -> None:
        if self.eviction == "benefit":
            free_and_check_scores(self.kv, SPECS, request)
        else:
            self.kv.free(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        request = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self._free(request)
        request.num_computed_tokens = 0
        self.preempted.append(request)

    @precondition(lambda self: self.preempted)
    @rule(chunk=st.integers(1, 30))
    def resume(self, chunk: int) -> None:
        self._admit(self.preempted.pop(0), chunk)

    @rule(size=st.integers(10, 60))
    def evict(self, size: int) -> None:
        """A cold request big enough to reuse (evict) cached pages, then gone."""
        self.ids += 1
        request = Request(f"x{self.ids}", [100 + self.rng.randrange(50) for _ in range(size)],
                          SamplingParams(max_tokens=1))
        if self.kv.allocate_slots(request, size):
            request.num_computed_tokens = size
            self._run_step(request, 0, size)
            self._free(request)

    # ---- invariants --------------------------------------------------------------
    @invariant()
    def accounting_matches_the_shadow(self) -> None:
        refs: dict[int, int] = {}
        per_group = [set() for _ in self.kv.allocators]
        pool = self.kv.pool
        for g, alloc in enumerate(self.kv.allocators):
            for rid in [*self.running, *self.loading]:
                if isinstance(alloc, RecurrentStateAllocator):
                    if rid in self.running:
                        assert len(alloc.block_ids(self.running[rid])) == alloc.state_pages
                    held = alloc.held_blocks(rid)
                else:
                    held = [b for b in alloc.req_to_blocks.get(rid, []) if b is not NULL_BLOCK]
                for block in held:
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
                    per_group[g].add(block.block_id)
            assert set(alloc.req_to_blocks) <= set(self.running) | set(self.loading)
        # pages a hit restores from: a checkpoint, maybe dropped from the cache since (a
        # superseded rolling one) but still read by the step in flight
        restoring = {b.block_id for g in self.recurrent for seq in self.kv.allocators[g].seqs.values()
                     for b in seq.restore}
        for pages, states in self.held:  # never handed out: the state they were saved with
            for block, state in zip(pages, states, strict=True):
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
                assert state is not None and self.content.get(block.block_id) == state
        for block_id, count in refs.items():
            block = pool.blocks[block_id]
            assert block.ref_cnt == count, (block_id, block.ref_cnt, count)
            # shared: cached content, or a checkpoint being restored from
            assert count == 1 or block.block_hash is not None or block_id in restoring
        free = [b for b in pool.blocks[pool.num_reserved:] if b.ref_cnt == 0]
        assert len(free) == pool.num_free_blocks
        assert len(free) + len(refs) == pool.num_usable_blocks  # no leak
        assert self.kv.blocks_in_use_per_group() == [len(s) for s in per_group]
        live = set().union(*per_group)  # pages only held for a save belong to no request
        assert sum(len(s) for s in per_group) == len(live)  # no page in two groups
        # a slot is never cached, never shared
        for g in self.recurrent:
            for request in self.running.values():
                for block_id in self.kv.allocators[g].block_ids(request):
                    assert pool.blocks[block_id].block_hash is None
                    assert pool.blocks[block_id].ref_cnt == 1


    def teardown(self) -> None:
        if self.eviction == "benefit":
            RecurrentArena.num_evictions += self.pool.num_evictions


class RecurrentArenaLRU(RecurrentArena):
    eviction = "lru"


RecurrentArena.TestCase.settings = settings(max_examples=50, stateful_step_count=40,
                                            deadline=None)
TestRecurrentArena = RecurrentArena.TestCase
RecurrentArenaLRU.TestCase.settings = settings(max_examples=15, stateful_step_count=40,
                                               deadline=None)
TestRecurrentArenaLRU = RecurrentArenaLRU.TestCase


def test_the_machines_evicted():
    """The runs above (in file order) put the pool under pressure."""
    assert RecurrentArena.num_evictions > 0
