"""The KV arena's allocators under random admit / extend / finish / evict / preempt
sequences, against a shadow model, for a hybrid of full attention and two sliding
windows drawing from one pool.

The shadow knows, per request and group, which table entries must hold a real block
(full attention: all; a window w: those a query at the next position still reads) and
what each block holds (the group and token ids of the block it was computed for). After
every step: no block is in two places unless it is one shared, cached prefix block; no
block leaks (free + held = usable); each block's reference count is its number of
table entries; per-group counts are exact; and every prefix-cache hit returns blocks
holding exactly the request's tokens. Under "benefit" eviction every eviction and every
freed prefix's scores are checked against tests/kv_eviction_shadow.py.
"""

from __future__ import annotations

import random

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_eviction_shadow import free_and_check_scores, install_checked_pool

from tokenmill.engine.request import Request
from tokenmill.kv.allocators import SlidingWindowAllocator
from tokenmill.kv.block_pool import NULL_BLOCK
from tokenmill.kv.eviction import RecomputeCost
from tokenmill.kv.groups import plan_groups
from tokenmill.kv.manager import KVCacheManager, PrefixHit
from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 48
# layers: full, window 5, full, window 9 -> gcd(2, 1, 1) = 1 layer per group, 4 groups
SPECS = [
    AttentionSpec(AttentionKind.FULL, 2, 1, 8, torch.float32, BLOCK),
    AttentionSpec(AttentionKind.SLIDING_WINDOW, 2, 1, 8, torch.float32, BLOCK, 5),
    AttentionSpec(AttentionKind.FULL, 2, 1, 8, torch.float32, BLOCK),
    AttentionSpec(AttentionKind.SLIDING_WINDOW, 2, 1, 8, torch.float32, BLOCK, 9),
]
LAYOUT = plan_groups(SPECS)
PREFIXES = [[7] * 13, list(range(20)), [3, 1, 4, 1, 5, 9, 2, 6] * 2]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, True, LAYOUT.groups,
                                 recompute_cost=RecomputeCost.from_specs(SPECS))
        self.pool = install_checked_pool(self.kv)
        self.running: dict[str, Request] = {}
        self.preempted: list[Request] = []
        self.ids = 0
        # block id -> (group, token ids) it holds once full; the shadow of the pages
        self.content: dict[int, tuple[int, tuple[int, ...]]] = {}
        # request id -> the computed length its windows last gave blocks back at
        self.released_at: dict[str, int] = {}
        self.rng = random.Random(0)

    # ---- helpers -----------------------------------------------------------------
    def _tokens_of(self, request: Request, j: int) -> tuple[int, ...]:
        return tuple(request.all_token_ids[j * BLOCK : (j + 1) * BLOCK])

    def _check_hit(self, request: Request, hit: PrefixHit, n: int) -> None:
        assert n == hit.num_tokens and n % BLOCK == 0 and n < request.num_tokens
        for g, table in enumerate(hit.tables):
            if n == 0:
                assert table == []
                continue
            assert len(table) == n // BLOCK
            for j, block in enumerate(table):
                if block is NULL_BLOCK:
                    alloc = self.kv.allocators[g]
                    assert j < alloc.first_needed_block(n)  # only what no query reads
                    continue
                assert self.content.get(block.block_id) == (g, self._tokens_of(request, j))

    def _record_content(self, request: Request) -> None:
        """The step computed the request's tokens: its full blocks now hold them."""
        for g, alloc in enumerate(self.kv.allocators):
            for j, block in enumerate(alloc.req_to_blocks.get(request.request_id, [])):
                if block is not NULL_BLOCK and (j + 1) * BLOCK <= request.num_computed_tokens:
                    self.content[block.block_id] = (g, self._tokens_of(request, j))

    def _grow(self, request: Request, n: int) -> bool:
        before = self.kv.pool.num_free_blocks
        self.released_at[request.request_id] = request.num_computed_tokens
        if not self.kv.allocate_slots(request, n):
            # only blocks leaving a window may have been given back
            assert self.kv.pool.num_free_blocks >= before
            return False
        request.num_computed_tokens += n
        self._record_content(request)
        return True

    def _admit(self, request: Request, chunk: int) -> None:
        hit, n = self.kv.find_cached_prefix(request)
        self._check_hit(request, hit, n)
        num_new = min(chunk, request.num_tokens - n)
        free_before = self.kv.pool.num_free_blocks
        if self.kv.allocate_slots(request, num_new, hit):
            self.released_at[request.request_id] = n
            request.num_computed_tokens = n + num_new
            self.running[request.request_id] = request
            self._record_content(request)
        else:
            assert self.kv.pool.num_free_blocks == free_before
            assert self.kv.num_blocks_held(request) == [0] * self.kv.num_groups
            self.preempted.append(request)

    # ---- rules -------------------------------------------------------------------
    @rule(prefix=st.sampled_from(range(len(PREFIXES))), tail=st.integers(0, 30),
          chunk=st.integers(1, 40))
    def admit(self, prefix: int, tail: int, chunk: int) -> None:
        self.ids += 1
        tokens = PREFIXES[prefix] + [self.rng.randrange(50) for _ in range(tail)]
        request = Request(f"r{self.ids}", tokens, SamplingParams(max_tokens=8))
        self._admit(request, chunk)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.integers(1, 12))
    def extend(self, data, n: int) -> None:
        """A prompt chunk, or a decode step (which appends the sampled token first)."""
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(self.rng.randrange(50))
            n = 1
        self._grow(request, min(n, request.num_tokens - request.num_computed_tokens))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        free_and_check_scores(self.kv, SPECS, self.running.pop(rid))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        request = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        free_and_check_scores(self.kv, SPECS, request)
        request.num_computed_tokens = 0
        self.preempted.append(request)

    @precondition(lambda self: self.preempted)
    @rule(chunk=st.integers(1, 40))
    def resume(self, chunk: int) -> None:
        """A preempted (or refused) request comes back, from the prefix cache if it can."""
        self._admit(self.preempted.pop(0), chunk)

    @rule(size=st.integers(20, 120))
    def evict(self, size: int) -> None:
        """A cold request big enough to reuse (evict) cached blocks, then gone."""
        self.ids += 1
        request = Request(f"x{self.ids}", [100 + self.rng.randrange(50) for _ in range(size)],
                          SamplingParams(max_tokens=1))
        if self.kv.allocate_slots(request, size):
            request.num_computed_tokens = size
            self._record_content(request)
            free_and_check_scores(self.kv, SPECS, request)

    # ---- invariants --------------------------------------------------------------
    @invariant()
    def tables_match_the_shadow(self) -> None:
        refs: dict[int, int] = {}
        owners: dict[int, set[tuple[int, int]]] = {}
        per_group = [set() for _ in self.kv.allocators]
        for g, alloc in enumerate(self.kv.allocators):
            assert set(alloc.req_to_blocks) <= set(self.running)
            for rid, request in self.running.items():
                table = alloc.req_to_blocks.get(rid, [])
                assert len(table) == _cdiv(request.num_computed_tokens, BLOCK)
                # entries a window no longer read at the last allocation are null; all
                # others are real
                first = 0
                if isinstance(alloc, SlidingWindowAllocator):
                    first = alloc.first_needed_block(self.released_at[rid])
                for j, block in enumerate(table):
                    assert (block is NULL_BLOCK) == (j < first), (rid, g, j, first)
                for j, block in enumerate(table):
                    if block is NULL_BLOCK:
                        continue
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
                    owners.setdefault(block.block_id, set()).add((g, j))
                    per_group[g].add(block.block_id)
        pool = self.kv.pool
        for block_id, count in refs.items():
            block = pool.blocks[block_id]
            assert block.ref_cnt == count, (block_id, block.ref_cnt, count)
            # shared only as one cached prefix block of one group, at one index
            assert count == 1 or (len(owners[block_id]) == 1 and block.block_hash is not None)
        # no leak: every usable block is either free (ref 0) or held
        free = [b for b in pool.blocks[pool.num_reserved:] if b.ref_cnt == 0]
        assert len(free) == pool.num_free_blocks
        assert len(free) + len(refs) == pool.num_usable_blocks
        assert NULL_BLOCK.ref_cnt == 1 and pool.blocks[0] is NULL_BLOCK
        assert self.kv.blocks_in_use_per_group() == [len(s) for s in per_group]
        assert sum(len(s) for s in per_group) == len(refs)  # no block in two groups


    def teardown(self) -> None:
        ArenaMachine.num_evictions += self.pool.num_evictions


ArenaMachine.num_evictions = 0  # over every run: the pool must come under pressure
ArenaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestArena = ArenaMachine.TestCase


def test_the_machine_evicted():
    """The runs above (in file order) put the pool under pressure."""
    assert ArenaMachine.num_evictions > 0


def test_layout_groups_each_type():
    assert [g.kind for g in LAYOUT.groups] == [
        AttentionKind.FULL, AttentionKind.FULL, AttentionKind.SLIDING_WINDOW,
        AttentionKind.SLIDING_WINDOW,
    ]
    assert LAYOUT.num_slots == 1 and LAYOUT.layer_group == (0, 2, 1, 3)


def test_a_window_holds_only_its_blocks_at_any_length():
    kv = KVCacheManager(200, BLOCK, True, plan_groups(SPECS[1:2]).groups)
    request = Request("long", list(range(400)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(request, 40)
    request.num_computed_tokens = 40
    for _ in range(360 // 8):
        assert kv.allocate_slots(request, 8)
        request.num_computed_tokens += 8
        # chunk of 8 from a position past the window of 5: the blocks of (p - 5, p + 8]
        assert kv.num_blocks_held(request)[0] <= _cdiv(5 + 8, BLOCK) + 1
    table = kv.group_block_ids(request)[0]
    assert len(table) == 100 and table[:95] == [NULL_BLOCK.block_id] * 95


def test_a_hit_needs_only_the_windows_last_blocks():
    """A prefix whose early window blocks were evicted still hits in full: full attention
    has every block, each window the blocks its next query reads."""
    kv = KVCacheManager(NUM_BLOCKS, BLOCK, True, LAYOUT.groups)
    tokens = list(range(40))
    a = Request("a", tokens, SamplingParams(max_tokens=1))
    for _ in range(10):  # chunks of 4: the windows give their early blocks back meanwhile
        assert kv.allocate_slots(a, 4)
        a.num_computed_tokens += 4
    kv.free(a)
    # a cold request takes the least recently freed blocks: the windows' early ones
    cold = Request("cold", [99] * 16, SamplingParams(max_tokens=1))
    assert kv.allocate_slots(cold, 16)
    windows = [alloc for alloc in kv.allocators if isinstance(alloc, SlidingWindowAllocator)]
    first_key = a.block_hashes[0]
    assert all(kv.pool.get_cached_block(w.key(first_key)) is None for w in windows)
    b = Request("b", tokens + [7, 7], SamplingParams(max_tokens=1))
    hit, n = kv.find_cached_prefix(b)
    assert n == 40
    for alloc, table in zip(kv.allocators, hit.tables, strict=True):
        first = alloc.first_needed_block(40) if alloc in windows else 0
        assert all((blk is NULL_BLOCK) == (j < first) for j, blk in enumerate(table))
    assert kv.allocate_slots(b, 2, hit)
