"""KV accounting as a state machine: the real Scheduler and KVCacheManager, driven by
hypothesis through random add / step / finish / abort / preempt under tiny pools with
prefix caching on, against a shadow of what every KV slot holds.

The shadow plays the runner: each step writes, for every scheduled token, the token ids
of the sequence up to and including it into the slot the request's block table names
(the KV at position p is a function of tokens 0..p). Slots keep their content across
free and reuse, as device memory does, so a block handed out twice or a stale cache hit
shows up as a request reading someone else's tokens.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.kv.manager import KVCacheManager
from tokenmill.sampling_params import SamplingParams

TOKENS = st.integers(0, 2)  # a tiny vocabulary, so that sequences share prefixes often
HISTORY = (0, 1, 2, 0, 2, 1, 1, 0, 2, 2, 0, 0, 1)  # a conversation several requests continue
# a prompt: some of the shared history (none: a cold prompt), then tokens of its own
PROMPTS = st.builds(
    lambda n, own: list(HISTORY[:n]) + own,
    st.integers(0, len(HISTORY)),
    st.lists(st.integers(0, 5), max_size=8),
).filter(bool)
DRAIN_STEPS = 400  # generous: every non-empty step computes at least one token


class KVAccounting(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(2, 6),
        block_size=st.sampled_from([2, 4]),
        budget=st.integers(1, 12),
        max_seqs=st.integers(1, 4),
        long_prefill=st.integers(0, 4),
        eviction=st.sampled_from(["benefit", "lru"]),
    )
    def setup(self, num_blocks, block_size, budget, max_seqs, long_prefill, eviction):
        self.bs = block_size
        self.capacity = num_blocks * block_size
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True,
                                 eviction=eviction)
        config = SchedulerConfig(max_seqs, budget, self.capacity, long_prefill)
        self.sched = Scheduler(config, self.kv)
        # block id -> per slot: the token ids the KV there encodes (None: never written)
        self.slots: list[list[tuple[int, ...] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.max_len: dict[str, int] = {}  # request id -> length at which it finishes
        # block hash -> (cache salt, the token ids of the whole prefix the block ends)
        self.hash_prefix: dict[bytes, tuple[str | None, tuple[int, ...]]] = {}
        self.num_added = 0

    # ---- rules ---------------------------------------------------------------------------
    @rule(
        # several at once: requests arriving in the same step compete for the same blocks
        prompts=st.lists(PROMPTS, min_size=1, max_size=3),
        max_new=st.integers(1, 6),
        salt=st.sampled_from([None, None, None, "tenant"]),
        prompt_logprobs=st.sampled_from([None, None, None, None, 1]),
    )
    def add(self, prompts, max_new, salt, prompt_logprobs):
        for prompt in prompts:
            # the engine refuses requests longer than the pool (max_model_len = capacity)
            prompt = prompt[: self.capacity - 1]
            rid = f"r{self.num_added}"
            self.num_added += 1
            params = SamplingParams(max_tokens=None, prompt_logprobs=prompt_logprobs)
            self.sched.add_request(Request(rid, prompt, params, cache_salt=salt))
            self.max_len[rid] = min(self.capacity, len(prompt) + max_new)

    @rule(data=st.data())
    def step(self, data):
        self._step(lambda: data.draw(TOKENS, label="sampled token"))

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data(), aborted=st.booleans())
    def finish_running(self, data, aborted):
        request = data.draw(st.sampled_from(self.sched.running), label="finished")
        status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_STOPPED
        assert self.sched.finish(request.request_id, status) is request

    @precondition(lambda self: self.sched.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        request = data.draw(st.sampled_from(list(self.sched.waiting)), label="aborted")
        assert self.sched.finish(request.request_id, RequestStatus.FINISHED_ABORTED) is request

    @precondition(lambda self: self.sched.running)
    @rule()
    def preempt_newest(self):
        # what schedule() does when KV runs out, forced at any moment
        self.sched._preempt(self.sched.running.pop())

    @rule()
    def drain(self):
        """Run until every request has ended: nothing may hang and nothing may leak."""
        for _ in range(DRAIN_STEPS):
            if not self.sched.has_unfinished_requests():
                break
            self._step(lambda: 1)
        assert not self.sched.has_unfinished_requests(), "requests never finished"
        assert self.kv.usage == 0.0
        assert not self.kv.allocators[0].req_to_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)

    # ---- the runner's part ---------------------------------------------------------------
    def _step(self, sample_token) -> None:
        unfinished = self.sched.has_unfinished_requests()
        out = self.sched.schedule()
        assert out.scheduled or not unfinished, "a step with unfinished requests did nothing"
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        for item in out.scheduled:  # batch order, as a runner writes a layer's KV
            request = self.sched.requests[item.request_id]
            self._record_hashes(request)
            assert request.status == RequestStatus.RUNNING
            start, end = item.start_position, item.start_position + len(item.token_ids)
            assert start == request.num_computed_tokens and end <= request.num_tokens
            assert item.token_ids == request.all_token_ids[start:end]
            assert item.sample == (end == request.num_tokens)
            table = self.kv.block_ids(request)
            assert item.block_ids == table
            assert len(table) * self.bs >= end, "the block table does not cover the step"
            tokens = tuple(request.all_token_ids)
            # what the request attends to: its own prefix, from a cache hit or its own steps
            for p in range(start):
                assert self._read(table, p) == tokens[: p + 1], (request.request_id, p)
            for p in range(start, end):
                self.slots[table[p // self.bs]][p % self.bs] = tokens[: p + 1]
        self.sched.update_computed(out)
        for item in out.scheduled:
            request = self.sched.requests[item.request_id]
            if item.sample:
                request.append_output_token(sample_token())
                if request.num_tokens >= self.max_len[request.request_id]:
                    self.sched.finish(request.request_id, RequestStatus.FINISHED_LENGTH)

    def _record_hashes(self, request: Request) -> None:
        for i, block_hash in enumerate(request.block_hashes):
            key = (request.cache_salt, tuple(request.all_token_ids[: (i + 1) * self.bs]))
            assert self.hash_prefix.setdefault(block_hash, key) == key, "hash collision"

    def _read(self, table: list[int], position: int) -> tuple[int, ...] | None:
        return self.slots[table[position // self.bs]][position % self.bs]

    # ---- invariants ----------------------------------------------------------------------
    @invariant()
    def every_request_holds_its_own_tokens(self):
        # covers blocks shared by two requests: each reads its own prefix there
        for request in self.sched.running:
            table = self.kv.block_ids(request)
            tokens = tuple(request.all_token_ids)
            for p in range(request.num_computed_tokens):
                assert self._read(table, p) == tokens[: p + 1], (request.request_id, p)
        for request in self.sched.waiting:
            assert not self.kv.block_ids(request) and request.num_computed_tokens == 0

    @invariant()
    def ref_counts_equal_references_and_free_queue_partitions_the_pool(self):
        pool = self.kv.pool
        refs = [0] * pool.num_blocks
        live = {r.request_id for r in self.sched.running}
        assert set(self.kv.allocators[0].req_to_blocks) <= live
        for blocks in self.kv.allocators[0].req_to_blocks.values():
            assert len({id(b) for b in blocks}) == len(blocks), "a request holds a block twice"
            for block in blocks:
                refs[block.block_id] += 1
        assert [b.ref_cnt for b in pool.blocks] == refs
        free = [b.block_id for b in pool.free_blocks()]
        assert len(set(free)) == len(free), "a block is free twice"
        assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        assert all(pool.blocks[i].ref_cnt == 0 for i in free)
        assert pool.num_free_blocks == len(free)

    @invariant()
    def every_cached_block_holds_the_prefix_its_hash_names(self):
        for request in self.sched.requests.values():
            self._record_hashes(request)
        pool = self.kv.pool
        for block_hash, block in pool._cached.items():
            assert block.block_hash == block_hash
            _, prefix = self.hash_prefix[block_hash]
            first = len(prefix) - self.bs
            for j in range(self.bs):
                assert self.slots[block.block_id][j] == prefix[: first + j + 1]
        for block in pool.blocks:
            assert block.block_hash is None or pool._cached.get(block.block_hash) is block


KVAccounting.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_accounting = KVAccounting.TestCase
