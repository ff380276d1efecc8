"""The worker's table of the requests it runs, kept up to date from each step description.

What the sampler needs per request (token ids for penalties, sampling parameters, the
seeded generator) and what the runner needs (block table, computed tokens) live here, on
the worker's side of the step seam; the engine core sends each request whole once and
deltas after (see `tokenmill.platforms.step`). Any model runner may use this table: it holds no
model or device state but the generators.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.platforms.kit.sampler import make_generator, replay_draws
from tokenmill.platforms.step import RecurrentStateOps, SamplingSpec, StepDescription


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (the worker's copy)
    sampling: SamplingSpec
    generator: torch.Generator | None  # seeded per request; None: the global RNG
    block_ids: list[int]  # the whole block table (KV group 0's)
    num_computed_tokens: int  # tokens in the KV cache before the current step
    extra_block_ids: list[list[int]] = field(default_factory=list)  # KV groups 1, 2, ...
    # this step's recurrent-state operations (restore, checkpoints), per LINEAR group id
    recurrent_ops: dict[int, RecurrentStateOps] = field(default_factory=dict)

    def tables(self) -> list[list[int]]:
        """The block table of every KV group, in group order."""
        return [self.block_ids, *self.extra_block_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]


@dataclass(frozen=True, slots=True)
class ScheduledRow:
    """One request's share of the step, as the worker resolves it from its table."""

    state: RequestState
    num_tokens: int  # tokens computed this step, from state.num_computed_tokens on
    sample: bool  # the step completes the request's known tokens: it samples
    # speculative decoding: draft tokens after the known ones, verified this step (they
    # are the last len(draft_token_ids) of num_tokens)
    draft_token_ids: list[int] = field(default_factory=list)

    def token_ids(self) -> list[int]:
        """The ids of the tokens computed this step: known ones, then the drafts."""
        start = self.state.num_computed_tokens
        known = self.state.token_ids(start, start + self.num_tokens - len(self.draft_token_ids))
        return known + self.draft_token_ids if self.draft_token_ids else known

    @property
    def start(self) -> int:
        return self.state.num_computed_tokens


class StepProtocolError(RuntimeError):
    """A step refers to a request the worker does not hold, or re-adds one it holds."""


class RequestStateTable:
    """A runner's per-request state, kept from the steps alone: new requests added,
    cached ones extended with their new tokens and blocks, finished, aborted and
    preempted ones dropped (`update`); each request's generator seeded (or replayed past
    the draws already made) so seeded sampling survives preemption."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.requests: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def update(self, step: StepDescription) -> list[ScheduledRow]:
        """Apply `step` to the table; return its batch in order."""
        for ids in (step.finished_request_ids, step.aborted_request_ids,
                    step.preempted_request_ids):
            for rid in ids:
                self.requests.pop(rid, None)  # never scheduled here (e.g. rank-local): fine
        for new in step.new_requests:
            if new.request_id in self.requests:
                raise StepProtocolError(
                    f"step {step.step_id} adds request {new.request_id!r} that the worker "
                    "already holds; the engine core must finish or preempt it first"
                )
            generator = make_generator(new.seed, self.device)
            if generator is not None and not new.sampling.greedy:
                replay_draws(generator, len(new.output_token_ids))
            self.requests[new.request_id] = RequestState(
                request_id=new.request_id,
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids),
                sampling=new.sampling,
                generator=generator,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                extra_block_ids=[list(t) for t in new.extra_block_ids],
            )
        for cached in step.cached_requests:
            state = self._get(cached.request_id, step)
            state.output_token_ids.extend(cached.new_token_ids)
            if cached.block_table_lens:
                for table, n in zip(state.tables(), cached.block_table_lens, strict=True):
                    del table[n:]
            state.block_ids.extend(cached.new_block_ids)
            for table, new_ids in zip(state.extra_block_ids, cached.extra_new_block_ids,
                                      strict=True):
                table.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        rows = []
        for rid, num_tokens in zip(step.scheduled_request_ids, step.num_scheduled_tokens,
                                   strict=True):
            state = self._get(rid, step)
            state.recurrent_ops = {op.group_id: op for op in step.recurrent_state.get(rid, ())}
            drafts = step.spec_token_ids.get(rid, [])
            end = state.num_computed_tokens + num_tokens
            known = state.num_tokens + len(drafts)
            if end > known or (drafts and end != known):
                raise StepProtocolError(
                    f"step {step.step_id} schedules {num_tokens} tokens of request {rid!r} "
                    f"from {state.num_computed_tokens}, but it holds {state.num_tokens} and "
                    f"{len(drafts)} drafts (drafts follow every known token)"
                )
            rows.append(ScheduledRow(state, num_tokens, sample=end == known,
                                     draft_token_ids=list(drafts)))
        return rows

    def _get(self, request_id: str, step: StepDescription) -> RequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise StepProtocolError(
                f"step {step.step_id} refers to request {request_id!r}, which the worker "
                "does not hold (it was never sent as a new request, or was dropped)"
            )
        return state
