"""Continuous batching under a per-step token budget.

The one invariant: each request's `num_computed_tokens` catches up with its `num_tokens`.
There are no prefill or decode phases: a step first gives every decoding request its
one token, then spends the rest of the budget on prompt tokens, shortest remaining
prefill first, over the running requests' unfinished prompts and the waiting requests
(after their prefix-cache hits) alike: an agent's next turn, whose history is cached,
computes its few new tokens at once instead of queueing behind a long cold prompt. One
request takes at most `long_prefill_token_threshold` prompt tokens per step (0: no cap),
so a long prompt cannot make a step that every arriving turn waits out. When KV runs
out, the most recently admitted running request is preempted: its blocks are freed and
it is recomputed later, from the prefix cache where possible, with identical output. The
same happens when the chunks of several prompts fill the pool and none can grow.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler_handover import SchedulerHandover
from tokenmill.kv.block_pool import NULL_BLOCK
from tokenmill.kv.manager import KVCacheManager, PrefixHit
from tokenmill.kv_connector.handover.scheduler_side import HandoverScheduler
from tokenmill.kv_connector.scheduler_side import KVConnectorScheduler
from tokenmill.platforms.kv_messages import WorkerReport
from tokenmill.platforms.step import (
    CachedRequest,
    NewRequest,
    RecurrentStateOps,
    SamplingSpec,
    StepDescription,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.scheduling import SpecDecodeScheduling

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step. Plain data: the runner needs nothing else."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step, in order
    start_position: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_ids: list[int]  # the request's whole block table (KV group 0's)
    sample: bool  # whether this step completes the known tokens and samples a new one
    # prompt positions [start, end) whose next-token logprobs are wanted (empty: none)
    prompt_logprobs_range: tuple[int, int] = (0, 0)
    # the block tables of KV groups 1, 2, ... (hybrid models; core/kv/groups.py)
    extra_block_ids: tuple[list[int], ...] = ()
    # speculative decoding: the drafts verified this step, the last of token_ids
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_known_tokens(self) -> int:
        """Tokens of the request's own computed this step (token_ids less the drafts)."""
        return len(self.token_ids) - len(self.draft_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """A whole step: what to compute, in batch order.

    `scheduled` is the scheduler's own view (the engine advances its requests with it);
    `step` is the same step as the workers get it, self-contained (`tokenmill.platforms.step`).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0
    step: StepDescription = field(default_factory=lambda: StepDescription(step_id=-1))

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
    # the most prompt tokens one request computes in a step (0: up to the whole budget)
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} must be >= 0"
            )


class Scheduler(SchedulerHandover):
    # waiting requests looked at per step (each costs a prefix-cache lookup)
    _WAITING_LOOKAHEAD = 256

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.workers = WorkerView()  # what the workers hold, to send them deltas only
        # KV offload (core/kv_connector/): set by the engine when tiers are configured
        self._connector: KVConnectorScheduler | None = None
        self.loading: dict[str, Request] = {}  # WAITING_FOR_KV: their loads in flight
        self.parked: dict[str, Request] = {}  # finished while loading: blocks freed on report
        self._max_scheduled = config.max_num_seqs  # this schedule() call's request cap
        # speculative decoding (core/spec_decode/): set by the engine when configured
        self.spec: SpecDecodeScheduling | None = None
        self._drafts: dict[str, list[int]] = {}  # this schedule() call's planned drafts
        # prefill/decode disaggregation (core/kv_connector/handover/): set by the engine
        self.handover: HandoverScheduler | None = None

    @property
    def connector(self) -> KVConnectorScheduler | None:
        return self._connector

    @connector.setter
    def connector(self, connector: KVConnectorScheduler | None) -> None:
        """Offload's scheduler side; it hears of the pool's evictions from now on."""
        self._connector = connector
        if connector is not None:
            connector.attach(self.kv.pool)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.parked:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.connector is not None and request.session_id is not None:
            _, num_hit = self.kv.find_cached_prefix(request)
            self.connector.request_arrived(request, num_hit)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or (KV offload) held state saves no step has carried."""
        return bool(self.waiting or self.running or self.loading or self.parked) or (
            self.connector is not None and self.connector.has_unsent_saves
        )

    def schedule(self, max_num_scheduled: int | None = None) -> SchedulerOutput:
        """The next step. `max_num_scheduled`: the most requests it holds (pipeline
        parallel splits the running requests into micro-batches this way).

        With steps in flight (pipeline parallel: the engine advances `num_computed_tokens`
        when it submits a step, `update_computed`), a request whose every known token is
        computed or in flight waits for its sampled token and is not scheduled; the next
        chunk of a prompt is, so one prompt's chunks flow through the stages together."""
        out = SchedulerOutput()
        self._max_scheduled = max_num_scheduled or self.config.max_num_seqs
        while True:
            scheduled = self._schedule_decodes(out)
            scheduled += self._schedule_prompts(out, scheduled)
            if scheduled or not any(r.num_tokens > r.num_computed_tokens for r in self.running):
                break
            # Every running request is mid-prompt and none can grow (chunks of several
            # prompts fill the pool): nothing would ever finish. The newest gives its
            # blocks up, which lets the others through; nothing was allocated this pass.
            self._preempt(self.running.pop())
            out.num_preempted += 1
        for request, num_new in scheduled:
            out.scheduled.append(
                self._describe(request, num_new, self._drafts.get(request.request_id, ()))
            )
        if self.connector is not None:
            self._prefetch_waiting()
        # an empty step is not run (ended ids wait for the next one), unless the KV
        # connector has loads to start or in flight, or held pages to save or release
        if scheduled or self.loading or self.parked or (
            self.connector is not None
            and (self.connector.has_unsent_saves or self.connector.holds_blocks)
        ):
            out.step = self.workers.describe_step(scheduled, out.scheduled)
            for (request, _), item in zip(scheduled, out.scheduled, strict=True):
                # recurrent layers: restores and checkpoints (and draft snapshots)
                if self.spec is not None:
                    ops = self.spec.recurrent_ops(self.kv, request, len(item.draft_token_ids))
                else:
                    ops = [RecurrentStateOps(g, restore, checkpoints)
                           for g, restore, checkpoints in self.kv.recurrent_step_ops(request)]
                if ops:
                    out.step.recurrent_state[request.request_id] = ops
            if self.handover is not None:
                out.step.kv_handover = self.handover.step_meta()
            if self.connector is not None:
                # saves cover known tokens only (drafts are never saved), from where the
                # last step's accepted drafts began: the blocks they filled are saved now
                back = self.spec.accepted_last if self.spec is not None else {}
                out.step.kv_connector = self.connector.build_step_meta(
                    [(r, self.kv.group_block_ids(r),
                      r.num_computed_tokens - back.get(r.request_id, 0),
                      n + back.get(r.request_id, 0))
                     for r, n in scheduled],
                    [kb for r, _ in scheduled for kb in self.kv.checkpoint_saves(r)],
                )
        return out

    # waiting requests whose tier-held blocks are prefetched into the host per step
    _PREFETCH_LOOKAHEAD = 8

    def _prefetch_waiting(self) -> None:
        """KV offload: the first waiting requests (not admitted this step) get their
        blocks that only durable tiers hold copied into the host while they wait, so
        their loads read memory when they are admitted (once per request)."""
        for request in list(self.waiting)[: self._PREFETCH_LOOKAHEAD]:
            if request.sampling_params.prompt_logprobs is None:
                _, num_hit = self.kv.find_cached_prefix(request)
                self.connector.prefetch(request, num_hit)

    def _schedule_decodes(self, out: SchedulerOutput) -> list[tuple[Request, int]]:
        """Decoding requests, one token each (plus their drafts, with speculative
        decoding), in admission order; KV shortage preempts the most recently admitted
        running request (a request first gives its drafts up)."""
        scheduled: list[tuple[Request, int]] = []
        budget = self.config.max_num_batched_tokens
        self._drafts = (
            self.spec.plan(self.running, self.config.max_model_len) if self.spec else {}
        )
        i = 0
        while i < len(self.running) and len(scheduled) < self._max_scheduled and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining != 1:
                # > 1: a prompt chunk, _schedule_prompts' business; 0: its step is in
                # flight, its next token not known yet (pipeline parallel)
                i += 1
                continue
            drafts = self._drafts.pop(request.request_id, [])[: budget - 1]
            if drafts and not self.spec.allocate(self.kv, request, drafts):
                drafts = []
            while not drafts and not self.kv.allocate_slots(request, 1):
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is request:
                    break
            else:
                if drafts:
                    self._drafts[request.request_id] = drafts
                scheduled.append((request, 1))
                budget -= 1 + len(drafts)
                i += 1
        return scheduled

    def _schedule_prompts(
        self, out: SchedulerOutput, decodes: list[tuple[Request, int]]
    ) -> list[tuple[Request, int]]:
        """Prompt tokens in the budget the decodes left, shortest remaining prefill first
        (running chunks and waiting requests alike; preempted requests ahead of all): a
        turn whose history is cached computes a few tokens and should not queue behind a
        long cold prompt. A long prompt still gets whatever budget the shorter ones leave,
        every step, up to long_prefill_token_threshold: one long prompt then cannot make a
        step as long as a full budget, which every turn arriving meanwhile would wait out.
        Waiting requests are admitted only in a step that preempted nothing."""
        budget = self.config.max_num_batched_tokens - len(decodes) - sum(
            len(self._drafts.get(r.request_id, ())) for r, _ in decodes
        )
        candidates: list[tuple[int, int, Request]] = []
        for request in self.running:
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > 1:
                candidates.append((1, remaining, request))
        admitting = not out.num_preempted
        if admitting:
            for request in list(self.waiting)[: self._WAITING_LOOKAHEAD]:
                _, num_hit = self.kv.find_cached_prefix(request)
                first = 0 if request.status == RequestStatus.PREEMPTED else 1
                candidates.append((first, request.num_tokens - num_hit, request))
        candidates.sort(key=lambda c: (c[0], c[1]))  # stable: arrival order breaks ties
        chunk_cap = self.config.long_prefill_token_threshold or budget
        scheduled: list[tuple[Request, int]] = []
        for _, remaining, request in candidates:
            if budget <= 0 or len(decodes) + len(scheduled) >= self._max_scheduled:
                break
            if request.status == RequestStatus.RUNNING:
                num_new = min(remaining, budget, chunk_cap)
                if self.kv.allocate_slots(request, num_new):  # else: next step
                    scheduled.append((request, num_new))
                    budget -= num_new
                continue
            if not admitting or len(self.running) + len(self.loading) >= self.config.max_num_seqs:
                continue
            if request.handover_in is not None:
                admitting = self._admit_handover(request)
                continue
            # The hits counted for sorting may be gone: an allocation earlier in this loop
            # may evict free cached blocks, hits included. Look them up
            # again right before allocating, with nothing in between.
            hits, num_hit = self.kv.find_cached_prefix(request)
            if self.connector is not None:
                loaded = self._start_external_load(request, hits, num_hit)
                if loaded is True:
                    continue  # admitted; computes once its load reports
                if loaded is None:
                    # a tier holds its next tokens but their blocks do not fit now: it
                    # waits for them (as a prompt that does not fit does) rather than
                    # starting a chunk that would recompute what the tier holds
                    admitting = False
                    continue
            num_new = min(request.num_tokens - num_hit, budget, chunk_cap)
            if not self.kv.allocate_slots(request, num_new, hits):
                # no KV for this one: admit nothing bigger either (running prompts go on)
                admitting = False
                continue
            self.waiting.remove(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                self.kv.record_lookup(request.num_tokens, num_hit)
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        return scheduled

    def _start_external_load(
        self, request: Request, hits: PrefixHit, num_hit: int
    ) -> bool | None:
        """Admit a waiting request whose next tokens a KV tier holds: allocate blocks for
        them (unpublished until loaded) and start the load. True: admitted; False:
        nothing to load (the caller tries the ordinary admission); None: a tier holds
        them but their blocks do not fit now (the request keeps waiting)."""
        num_external = self.connector.num_external_tokens(request, num_hit)
        if not num_external:
            return False
        # a sliding window needs no block before the one its window reads after the load:
        # the null block stands in for them, so the load allocates only what it fills
        end = num_hit + num_external
        padded = PrefixHit(num_hit, [
            table + [NULL_BLOCK] * (alloc.first_needed_block(end) - len(table))
            for alloc, table in zip(self.kv.allocators, hits.tables, strict=True)
        ])
        if not self.kv.allocate_slots(request, num_external, padded, publish=False):
            return None
        # and the device hit's window blocks that no query after the load reads go back
        for alloc in self.kv.allocators:
            alloc.release_outside_window(request, end)
        self.waiting.remove(request)
        if request.num_cached_tokens < 0:
            self.kv.record_lookup(request.num_tokens, num_hit)
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.WAITING_FOR_KV
        self.loading[request.request_id] = request
        self.connector.start_load(request, self.kv.load_block_ids(request), num_hit, num_external)
        return True

    def update_from_connector(self, report: WorkerReport | None) -> None:
        """Apply a KV connector report: a request whose load ended runs from the tokens
        that arrived (a failed block and those after it are recomputed); a finished one
        that was still loading gives its blocks back."""
        if self.connector is None or report is None:
            return
        outcomes = self.connector.process_report(report)
        self.kv.release(self.connector.take_released())
        for outcome in outcomes:
            parked = self.parked.pop(outcome.request_id, None)
            if parked is not None:
                self.kv.free(parked)
                continue
            request = self.loading.pop(outcome.request_id)
            if outcome.restart:
                # several KV groups, a failed load: no prefix of it is whole in every
                # group; admitted again, it computes what its device hit lacks
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.status = RequestStatus.WAITING
                self.waiting.appendleft(request)
                continue
            request.num_computed_tokens = outcome.num_computed_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = outcome.num_computed_tokens
            self.kv.cache_blocks(request, outcome.num_computed_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _describe(
        self, request: Request, num_new: int, drafts: list[int] | tuple[int, ...] = ()
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        lp_range = (0, 0)
        if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens:
            # logits at position p predict token p + 1; the last prompt position's logits are
            # the first sampled token's, so prompt logprobs cover positions [0, prompt - 1).
            lp_range = (start, min(end, request.num_prompt_tokens - 1))
        tables = self.kv.group_block_ids(request)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end] + list(drafts),
            start_position=start,
            block_ids=tables[0],
            sample=end == request.num_tokens,
            prompt_logprobs_range=lp_range,
            extra_block_ids=tuple(tables[1:]),
            draft_token_ids=tuple(drafts),
        )

    def update_computed(self, scheduler_output: SchedulerOutput) -> None:
        """Advance every scheduled request past the tokens the step computed."""
        for s in scheduler_output.scheduled:
            request = self.requests.get(s.request_id)
            if request is not None and not request.is_finished:
                request.num_computed_tokens = s.start_position + s.num_known_tokens

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a request (stopped, length or aborted) and free its KV. Unknown ids: None."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.loading.pop(request_id, None)
        request.status = status
        self._forget_drafts(request_id, finished=True)
        self._save_rolling_state(request)
        if self.handover is not None and self.handover.drop(request_id):
            self.parked[request_id] = request  # a pull still writes into its blocks
        elif self.connector is not None and self.connector.request_finished(request):
            self.parked[request_id] = request  # a load still writes into its blocks
        else:
            self.kv.free(request)
        aborted = status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
        self.workers.forget(request_id, aborted)
        return request

    def _save_rolling_state(self, request: Request) -> None:
        """KV offload of a model with recurrent layers: the request's latest state (its
        rolling checkpoint, where an agent's next turn continues) is saved once, now that
        no later one supersedes it; its pages stay held until the save reports."""
        if self.connector is not None and self.kv.recurrent_group_ids:
            held = self.kv.hold_rolling_checkpoints(request)
            self.kv.release(self.connector.save_rolling_checkpoints(held))

    def _forget_drafts(self, request_id: str, finished: bool) -> None:
        if self.spec is not None:
            self.spec.forget(request_id, finished)

    def _preempt(self, request: Request) -> None:
        self._forget_drafts(request.request_id, finished=False)
        self._save_rolling_state(request)
        self.kv.free(request)
        self.workers.preempt(request.request_id)
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


class WorkerView:
    """What the workers hold of each request, so that a step carries deltas only.

    A request is sent whole (`NewRequest`) the first time it is scheduled and again after a
    preemption (the workers drop it then); otherwise as a `CachedRequest` with the tokens
    and blocks it gained since. Ids that finish or are preempted are reported once, in
    the next step described.
    """

    def __init__(self) -> None:
        # id -> (num tokens, blocks per group) sent
        self._sent: dict[str, tuple[int, tuple[int, ...]]] = {}
        # id -> per group, the shortest its table was since last sent (speculative
        # decoding trims the blocks of rejected drafts, and the table may grow back)
        self._trimmed: dict[str, list[int]] = {}
        self._finished: list[str] = []
        self._aborted: list[str] = []
        self._preempted: list[str] = []
        self._step_id = 0

    def forget(self, request_id: str, aborted: bool) -> None:
        """The request ended: workers free its state (if they ever had it)."""
        self._trimmed.pop(request_id, None)
        if self._sent.pop(request_id, None) is not None:
            (self._aborted if aborted else self._finished).append(request_id)

    def preempt(self, request_id: str) -> None:
        self._trimmed.pop(request_id, None)
        if self._sent.pop(request_id, None) is not None:
            self._preempted.append(request_id)

    def trimmed(self, request_id: str, table_lens: list[int]) -> None:
        """The request's tables were cut to `table_lens` (per group) after the step."""
        sent = self._sent.get(request_id)
        if sent is None:
            return
        lens = self._trimmed.get(request_id, list(sent[1]))
        self._trimmed[request_id] = [min(a, b) for a, b in zip(lens, table_lens, strict=True)]

    def describe_step(
        self,
        requests: list[tuple[Request, int]],
        scheduled: list[ScheduledRequest],
    ) -> StepDescription:
        """The workers' step for `requests` (each with its number of new tokens), whose
        scheduler-side descriptions are `scheduled`."""
        step = StepDescription(
            step_id=self._step_id,
            finished_request_ids=self._finished,
            aborted_request_ids=self._aborted,
            preempted_request_ids=self._preempted,
        )
        self._step_id += 1
        self._finished, self._aborted, self._preempted = [], [], []
        for (request, _), item in zip(requests, scheduled, strict=True):
            rid = request.request_id
            sent = self._sent.get(rid)
            if sent is None:
                step.new_requests.append(
                    NewRequest(
                        request_id=rid,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=list(request.output_token_ids),
                        sampling=sampling_spec(request.sampling_params),
                        seed=request.seed,
                        block_ids=item.block_ids,
                        num_computed_tokens=item.start_position,
                        extra_block_ids=list(item.extra_block_ids),
                    )
                )
            else:
                # A window's table only grows: entries it nulls keep their old ids on the
                # workers, which never read them (they are outside the window).
                num_tokens, num_blocks = sent
                cut = self._trimmed.pop(rid, None)
                if cut is not None:
                    num_blocks = tuple(cut)
                step.cached_requests.append(
                    CachedRequest(
                        request_id=rid,
                        new_token_ids=request.all_token_ids[num_tokens:],
                        new_block_ids=item.block_ids[num_blocks[0] :],
                        num_computed_tokens=item.start_position,
                        extra_new_block_ids=[
                            t[n:] for t, n in zip(item.extra_block_ids, num_blocks[1:], strict=True)
                        ],
                        block_table_lens=list(cut) if cut is not None else [],
                    )
                )
            tables = (item.block_ids, *item.extra_block_ids)
            self._sent[rid] = (request.num_tokens, tuple(len(t) for t in tables))
            step.scheduled_request_ids.append(rid)
            step.num_scheduled_tokens.append(len(item.token_ids))
            if item.draft_token_ids:
                step.spec_token_ids[rid] = list(item.draft_token_ids)
            lo, hi = item.prompt_logprobs_range
            if hi > lo:
                step.prompt_logprob_ranges[rid] = (lo, hi)
        return step


def sampling_spec(params: SamplingParams) -> SamplingSpec:
    """The part of `params` the workers' sampler reads, every field concrete. The engine
    has filled the model's generation defaults in already; fields still unset (params
    that did not come through an engine) take the neutral values."""
    params = params.with_defaults()
    return SamplingSpec(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids or ()),
        eos_token_ids=sorted(params.eos_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        logit_bias=params.logit_bias,
    )
