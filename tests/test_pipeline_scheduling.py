"""The scheduler with steps in flight (pipeline parallel), as a stateful property test
against a shadow model, no model needed: steps are submitted (scheduled, their tokens
counted as computed) up to a depth and collected oldest first, with a deterministic
"model" whose token at position p of request r is f(r, p). Whatever the interleaving of
arrivals, submissions, collections, preemptions (a small KV pool) and aborts: a request
is never in two steps in flight unless they hold consecutive chunks of its prompt, every
request's outputs are exactly f(r, p) for p = its prompt length, +1, ... (a token of a
step that was preempted in flight is never applied), and everything drains."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenmill.engine.in_flight import InFlightSteps
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.kv.manager import KVCacheManager
from tokenmill.platforms.step import StepResult
from tokenmill.sampling_params import SamplingParams


def model_token(rid: str, position: int) -> int:
    return (int(rid) * 31 + position * 7) % 97


class PipelinedScheduler(RuleBasedStateMachine):
    @initialize(depth=st.integers(2, 3), num_blocks=st.integers(8, 24),
                budget=st.sampled_from([4, 8, 32]))
    def setup(self, depth, num_blocks, budget):
        kv = KVCacheManager(num_blocks, 4, True)
        self.scheduler = Scheduler(SchedulerConfig(8, budget, 64, 0), kv)
        self.queue = InFlightSteps(depth)
        self.next_id = 0
        self.max_tokens: dict[str, int] = {}
        self.prompts: dict[str, int] = {}
        self.done: dict[str, Request] = {}

    @rule(length=st.integers(1, 20), max_tokens=st.integers(1, 5), shared=st.booleans())
    def arrive(self, length, max_tokens, shared):
        rid = str(self.next_id)
        self.next_id += 1
        base = 0 if shared else 100 * self.next_id  # shared: prefix-cache hits
        request = Request(rid, [base + i for i in range(length)],
                          SamplingParams(max_tokens=max_tokens))
        self.prompts[rid], self.max_tokens[rid] = length, max_tokens
        self.scheduler.add_request(request)

    @precondition(lambda self: hasattr(self, "queue") and not self.queue.full)
    @rule()
    def submit(self):
        requests = self.scheduler.requests
        share = -(-len(requests) // self.queue.depth)
        plan = self.scheduler.schedule(max_num_scheduled=max(1, share))
        if plan.is_empty:
            return
        for s in plan.scheduled:  # contiguous with whatever of it is in flight
            request = requests[s.request_id]
            assert s.start_position == request.num_computed_tokens
            assert s.start_position + len(s.token_ids) <= request.num_tokens
        self.scheduler.update_computed(plan)
        self.queue.push(plan, None, requests)

    @precondition(lambda self: hasattr(self, "queue") and len(self.queue) > 0)
    @rule()
    def collect(self):
        entry = self.queue.pop()
        sampled = {s.request_id: model_token(s.request_id, s.start_position + len(s.token_ids))
                   for s in entry.plan.scheduled if s.sample}
        result = entry.current(StepResult(sampled_token_ids=sampled), self.scheduler.requests)
        for rid, token in result.sampled_token_ids.items():
            request = self.scheduler.requests[rid]
            request.append_output_token(token)
            if request.num_output_tokens >= self.max_tokens[rid]:
                self.done[rid] = request
                self.scheduler.finish(rid, RequestStatus.FINISHED_LENGTH)

    @rule(data=st.data())
    def abort(self, data):
        if hasattr(self, "scheduler") and self.scheduler.requests:
            rid = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
            self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            self.max_tokens.pop(rid)

    @invariant()
    def in_flight_steps_are_consistent(self):
        if not hasattr(self, "queue"):
            return
        seen: dict[str, int] = {}  # request -> end of its last step in flight
        for entry in self.queue._queue:
            for s in entry.plan.scheduled:
                request = self.scheduler.requests.get(s.request_id)
                if request is None or request.num_preemptions != entry.epochs[s.request_id]:
                    continue  # ended or preempted since: this step's share is stale
                if s.request_id in seen:
                    # only a prompt's next chunk may follow it into the pipeline
                    assert s.start_position == seen[s.request_id]
                    assert s.start_position < request.num_prompt_tokens
                seen[s.request_id] = s.start_position + len(s.token_ids)
        for request in self.scheduler.requests.values():
            assert request.num_computed_tokens <= request.num_tokens

    @invariant()
    def outputs_are_the_models_tokens_in_order(self):
        if not hasattr(self, "scheduler"):
            return
        for request in (*self.scheduler.requests.values(), *self.done.values()):
            rid, n = request.request_id, self.prompts[request.request_id]
            assert request.output_token_ids == [
                model_token(rid, n + i) for i in range(request.num_output_tokens)
            ]

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        for _ in range(2000):  # drain: every request finishes
            if not self.scheduler.has_unfinished_requests() and not len(self.queue):
                return
            if not self.queue.full:
                self.submit()
            if len(self.queue):
                self.collect()
        raise AssertionError(f"did not drain: {len(self.scheduler.requests)} requests left")


TestPipelinedScheduler = PipelinedScheduler.TestCase
TestPipelinedScheduler.settings = settings(max_examples=40, stateful_step_count=30,
                                           deadline=None)
