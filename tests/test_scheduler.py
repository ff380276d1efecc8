import pytest

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.kv.manager import KVCacheManager
from tokenmill.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, caching=True, long_prefill=0):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, 1024, long_prefill), kv)


def run_step(s: Scheduler, next_token: int = 7):
    """Play the runner: every request that samples gets `next_token`."""
    out = s.schedule()
    s.update_computed(out)
    for item in out.scheduled:
        if item.sample:
            s.requests[item.request_id].append_output_token(next_token)
    return out


def req(rid, n, max_tokens=4):
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens))


def test_chunked_prefill_under_budget_then_decode():
    s = make(budget=8)
    s.add_request(req("a", 20))
    steps = [run_step(s) for _ in range(4)]
    assert [st.num_tokens for st in steps] == [8, 8, 4, 1]
    assert [st.scheduled[0].sample for st in steps] == [False, False, True, True]
    assert steps[1].scheduled[0].start_position == 8
    assert s.requests["a"].num_output_tokens == 2


def test_long_prefill_threshold_caps_one_prompt_not_the_step():
    s = make(budget=16, long_prefill=6)
    s.add_request(req("long", 20))
    first = run_step(s)
    assert [(x.request_id, len(x.token_ids)) for x in first.scheduled] == [("long", 6)]
    # short prompts arriving meanwhile fill the rest of the budget beside the long one
    for rid, base in (("b", 300), ("c", 400)):  # no prefix shared with "long"
        s.add_request(Request(rid, list(range(base, base + 5)), SamplingParams(max_tokens=4)))
    second = run_step(s)
    assert sorted((x.request_id, len(x.token_ids)) for x in second.scheduled) == [
        ("b", 5), ("c", 5), ("long", 6)]
    # without the threshold the long prompt takes the whole budget
    s = make(budget=16)
    s.add_request(req("long", 20))
    assert run_step(s).num_tokens == 16
    with pytest.raises(ValueError, match="long_prefill_token_threshold=-1"):
        SchedulerConfig(8, 16, 1024, -1)


def test_decode_and_prefill_mix_in_one_step():
    s = make(budget=10)
    s.add_request(req("a", 5))
    run_step(s)
    s.add_request(req("b", 30))
    out = run_step(s)
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [("a", 1), ("b", 9)]


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2, budget=100)
    for i in range(3):
        s.add_request(req(str(i), 3))
    out = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["0", "1"]
    assert s.num_waiting == 1


def test_preemption_frees_and_recomputes():
    s = make(num_blocks=4, block_size=4, budget=64, caching=False)
    s.add_request(req("a", 7))
    s.add_request(req("b", 7))
    run_step(s)  # both admitted: 2 blocks each, pool full
    assert s.num_running == 2 and s.kv.pool.num_free_blocks == 0
    run_step(s)  # each needs token 9 -> "a" fits in block 2? 8 tokens fill 2 blocks exactly
    out = run_step(s)  # now 9 tokens: a needs a third block; b is preempted
    assert out.num_preempted == 1
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting[0] is b
    # once a finishes, b comes back and resumes from its known tokens
    s.finish("a", RequestStatus.FINISHED_STOPPED)
    out = run_step(s)
    assert out.scheduled[0].request_id == "b"
    assert out.scheduled[0].token_ids == b.all_token_ids[out.scheduled[0].start_position : -1]


def test_prefix_hit_skips_cached_tokens():
    s = make(budget=64)
    s.add_request(req("a", 10))
    run_step(s)
    s.add_request(req("b", 10))
    out = run_step(s)
    b_item = next(x for x in out.scheduled if x.request_id == "b")
    assert b_item.start_position == 8 and s.requests["b"].num_cached_tokens == 8
    assert s.kv.stats.queries == 20 and s.kv.stats.hits == 8


def test_abort_waiting_and_running_frees_blocks():
    s = make(budget=64)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10))
    run_step(s)
    s.add_request(req("c", 3))
    s.finish("a", RequestStatus.FINISHED_ABORTED)
    s.finish("c", RequestStatus.FINISHED_ABORTED)
    assert s.num_waiting == 0 and s.num_running == 1
    s.finish("b", RequestStatus.FINISHED_ABORTED)
    assert s.kv.usage == 0.0 and not s.has_unfinished_requests()
    assert s.finish("zzz", RequestStatus.FINISHED_ABORTED) is None


def test_shortest_remaining_prefill_goes_first():
    """A short prompt that arrives during a long prompt's chunked prefill is computed in the
    next step, ahead of the long prompt's next chunk; the long prompt takes what is left."""
    s = make(num_blocks=256, budget=16)
    s.add_request(req("long", 100))
    first = run_step(s)
    assert [(x.request_id, len(x.token_ids)) for x in first.scheduled] == [("long", 16)]
    s.add_request(Request("short", list(range(900, 905)), SamplingParams(max_tokens=4)))
    out = run_step(s)
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [("short", 5), ("long", 11)]
    assert out.scheduled[0].sample  # the short one's whole prompt: it samples at once
    out = run_step(s)  # the short one decodes first, the long one fills the rest
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [("short", 1), ("long", 15)]


def test_a_cached_history_counts_as_a_short_prefill():
    """Prefix-cache hits are taken off a waiting request's remaining tokens before ordering:
    the next turn of a cached conversation goes ahead of a cold prompt sent before it."""
    s = make(num_blocks=256, block_size=4, budget=64)
    s.add_request(req("turn1", 40, max_tokens=1))
    while s.has_unfinished_requests():
        out = run_step(s)
        for x in out.scheduled:
            if s.requests[x.request_id].num_output_tokens >= 1:
                s.finish(x.request_id, RequestStatus.FINISHED_LENGTH)
    s.add_request(Request("cold", list(range(500, 560)), SamplingParams(max_tokens=1)))
    s.add_request(req("turn2", 44, max_tokens=1))  # turn1's 40 tokens, then 4 new ones
    out = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["turn2", "cold"]
    assert out.scheduled[0].start_position == 40 and len(out.scheduled[0].token_ids) == 4


def test_a_cold_admission_cannot_take_a_block_another_admission_hit():
    """The cold request sorts first and takes the least recently freed block, which the
    other request counted as a hit while sorting: the hits are looked up again at
    allocation, so no block ends up in both tables."""
    s = make(num_blocks=6, block_size=4, budget=64)
    for rid, base in (("a", 10), ("b", 40)):  # fill the pool, then leave it all cached
        s.add_request(Request(rid, list(range(base, base + 12)), SamplingParams(max_tokens=1)))
    run_step(s)
    s.finish("a", RequestStatus.FINISHED_STOPPED)
    s.finish("b", RequestStatus.FINISHED_STOPPED)
    s.add_request(Request("cold", [70, 71, 72], SamplingParams(max_tokens=1)))
    s.add_request(Request("hit", list(range(10, 22)) + [80, 81, 82, 83], SamplingParams(max_tokens=1)))
    out = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["cold", "hit"]
    cold, hit = (set(x.block_ids) for x in out.scheduled)
    assert not cold & hit
    assert out.scheduled[1].start_position == 8  # a's first two blocks; the third is gone


def test_prompt_chunks_that_fill_the_pool_do_not_deadlock():
    """Two prompts each got a chunk and together hold every block; neither can grow. The
    newest is preempted so the oldest goes on, instead of every step doing nothing."""
    s = make(num_blocks=2, block_size=4, budget=5, long_prefill=3, caching=False)
    s.add_request(Request("a", [1] * 5, SamplingParams(max_tokens=1)))
    s.add_request(Request("b", [2] * 5, SamplingParams(max_tokens=1)))
    first = run_step(s)
    assert [(x.request_id, len(x.token_ids)) for x in first.scheduled] == [("a", 3), ("b", 2)]
    second = run_step(s)
    assert second.num_preempted == 1 and s.requests["b"].status == RequestStatus.PREEMPTED
    assert [(x.request_id, len(x.token_ids)) for x in second.scheduled] == [("a", 2)]


def test_a_waiting_request_that_does_not_fit_leaves_running_prompts_going():
    """A waiting request sorted ahead of a running prompt chunk finds no KV: admission
    stops there, and the running prompt still gets its next chunk."""
    s = make(num_blocks=4, block_size=4, budget=8)
    s.add_request(req("x", 8, max_tokens=1))
    s.add_request(Request("r", list(range(500, 516)), SamplingParams(max_tokens=1)))
    run_step(s)  # x's whole prompt: 2 blocks
    s.finish("x", RequestStatus.FINISHED_STOPPED)  # its 2 blocks stay cached, free
    run_step(s)  # r's first 8 tokens take the other 2 blocks
    # 5 tokens after x's cached 8 sort ahead of r's last 8, but need x's 2 blocks + 2 more
    s.add_request(req("w", 13, max_tokens=1))
    out = run_step(s)
    assert [(x.request_id, x.start_position, len(x.token_ids)) for x in out.scheduled] == [
        ("r", 8, 8)]
    assert out.num_preempted == 0 and s.requests["w"].status == RequestStatus.WAITING
