"""Continuous batching under a per-step token budget.

The one invariant: each request's `num_computed_tokens` catches up with its `num_tokens`.
There are no prefill or decode phases: a step gives every running request as many of its
uncomputed tokens as the budget allows (one for a decoding request, a chunk for a
prefilling one), then admits waiting requests. When KV runs out, the most recently
admitted running request is preempted: its blocks are freed and it is recomputed later,
from the prefix cache where possible, with identical output.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from tokenmill.kv.manager import KVCacheManager
from tokenmill.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step. Plain data: the runner needs nothing else."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step, in order
    start_position: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_ids: list[int]  # the request's whole block table
    sample: bool  # whether this step completes the known tokens and samples a new one
    # prompt positions [start, end) whose next-token logprobs are wanted (empty: none)
    prompt_logprobs_range: tuple[int, int] = (0, 0)


@dataclass(slots=True)
class SchedulerOutput:
    """A whole step: what to compute, in batch order."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1

        while self.waiting and budget > 0 and not out.num_preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            hits, num_hit = self.kv.find_cached_prefix(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                self.kv.record_lookup(request.num_tokens, num_hit)
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

        for request, num_new in scheduled:
            out.scheduled.append(self._describe(request, num_new))
        return out

    def _describe(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        lp_range = (0, 0)
        if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens:
            # logits at position p predict token p + 1; the last prompt position's logits are
            # the first sampled token's, so prompt logprobs cover positions [0, prompt - 1).
            lp_range = (start, min(end, request.num_prompt_tokens - 1))
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_position=start,
            block_ids=self.kv.block_ids(request),
            sample=end == request.num_tokens,
            prompt_logprobs_range=lp_range,
        )

    def update_computed(self, scheduler_output: SchedulerOutput) -> None:
        """Advance every scheduled request past the tokens the step computed."""
        for s in scheduler_output.scheduled:
            request = self.requests.get(s.request_id)
            if request is not None and not request.is_finished:
                request.num_computed_tokens = s.start_position + len(s.token_ids)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a request (stopped, length or aborted) and free its KV. Unknown ids: None."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        return request

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s", request.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
