"""Speculative decoding in the scheduler: which drafts each decoding request sends, the
KV they take, recurrent-state rollback, and what a verification leaves behind.

The scheduler calls in at four points: `plan` at the start of a step's decodes,
`allocate` per decoding request, `recurrent_ops` while describing the step, and
`forget` when a request ends or is preempted; the engine calls `verified` once the
step's tokens are appended. Pure Python with no device import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.engine.request import Request
from tokenmill.kv.manager import KVCacheManager
from tokenmill.platforms.step import RecurrentStateOps
from tokenmill.spec_decode.drafter import Drafter
from tokenmill.spec_decode.snapshots import StateSnapshots

if TYPE_CHECKING:
    from tokenmill.engine.scheduler import ScheduledRequest, Scheduler


class SpecDecodeScheduling:
    def __init__(self, drafter: Drafter, kv: KVCacheManager, num_speculative_tokens: int) -> None:
        self.drafter = drafter
        recurrent = {g: kv.groups[g].state_pages for g in kv.recurrent_group_ids}
        # recurrent layers: k + 1 snapshot sets per speculating request (spec_decode.snapshots)
        self.snapshots = (
            StateSnapshots(kv.pool, recurrent, num_speculative_tokens + 1) if recurrent else None
        )
        self.accepted_last: dict[str, int] = {}  # request id -> drafts accepted in its last step

    def plan(self, running: list[Request], max_model_len: int) -> dict[str, list[int]]:
        """The drafts each decoding request sends this step, as the drafter proposes and
        its adaptive planner keeps them."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        proposals = {}
        planner = self.drafter.planner
        if not planner.start_step(len(decoding)):
            return {}
        for request in decoding:
            if not planner.may_draft(request.request_id, len(decoding)):
                continue
            params = request.sampling_params
            # no draft past max_tokens or the context: 1 + k tokens may all be emitted
            room = max_model_len - request.num_tokens - 1
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - request.num_output_tokens - 1)
            drafts = self.drafter.propose(request, room)
            if drafts:
                proposals[request.request_id] = drafts
        return self.drafter.plan(proposals, len(decoding))

    def allocate(self, kv: KVCacheManager, request: Request, drafts: list[int]) -> bool:
        """KV for the request's next token and its drafts (attention slots past its known
        tokens, never published; snapshot pages for recurrent layers); False, with
        nothing taken, when they do not fit."""
        if self.snapshots is not None and not self.snapshots.ensure(request.request_id):
            return False
        return kv.allocate_slots(request, 1, num_lookahead_tokens=len(drafts))

    def recurrent_ops(self, kv: KVCacheManager, request: Request, num_drafts: int
                      ) -> list[RecurrentStateOps]:
        """The step's recurrent-state operations per LINEAR group: the allocator's
        (prefix-cache restores and checkpoints) and speculative decoding's (a rollback's
        restore, snapshots after each of the step's first num_drafts tokens)."""
        ops = {g: (restore, list(checkpoints))
               for g, restore, checkpoints in kv.recurrent_step_ops(request)}
        if self.snapshots is not None:
            snaps = self.snapshots.step_ops(request.request_id, request.num_computed_tokens,
                                            num_drafts)
            for g, (restore, checkpoints) in snaps.items():
                own_restore, own = ops.get(g, ([], []))
                if own_restore and restore:
                    raise RuntimeError(
                        f"request {request.request_id!r} restores group {g} from a prefix "
                        "hit and from a draft rollback in one step"
                    )
                ops[g] = (own_restore or restore, sorted(own + checkpoints, key=lambda c: c[0]))
        return [RecurrentStateOps(g, restore, checkpoints)
                for g, (restore, checkpoints) in sorted(ops.items())]

    def verified(self, scheduler: Scheduler, scheduled: list[ScheduledRequest],
                 accepted: dict[str, list[int]]) -> None:
        """After the step's outputs were appended (`scheduled`: its ScheduledRequests):
        a request that verified drafts counts the accepted ones as computed and gives
        back the KV past its tokens (the rejected drafts'; never published, as only
        known tokens' blocks are keyed)."""
        for s in scheduled:
            if not s.draft_token_ids:
                continue
            rid = s.request_id
            num_accepted = len(accepted.get(rid, ()))
            self.drafter.record(rid, len(s.draft_token_ids), num_accepted)
            request = scheduler.requests.get(rid)
            if request is None or request.is_finished:
                continue
            request.num_computed_tokens += num_accepted
            self.accepted_last[rid] = num_accepted
            table_lens = scheduler.kv.trim(request, request.num_tokens)
            if table_lens is not None:  # the workers cut their tables too, next step
                scheduler.workers.trimmed(rid, table_lens)
            if self.snapshots is not None:
                self.snapshots.verified(rid, len(s.draft_token_ids), num_accepted)

    def observe(self, scheduled: list[ScheduledRequest], accepted: dict[str, list[int]],
                seconds: float) -> None:
        """A step ran in `seconds`: the cost model learns it, and a decode-only step
        tells the outcome guard its tokens per second, with drafts or without."""
        self.drafter.observe_step(sum(len(s.token_ids) for s in scheduled), seconds)
        if scheduled and all(s.sample and s.num_known_tokens == 1 for s in scheduled):
            emitted = len(scheduled) + sum(len(v) for v in accepted.values())
            drafted = any(s.draft_token_ids for s in scheduled)
            self.drafter.planner.guard.observe(len(scheduled), emitted, seconds, drafted)

    def forget(self, request_id: str, finished: bool) -> None:
        """The request ended (`finished`) or was preempted: its snapshots go back; an
        ended one's drafter state goes too."""
        self.accepted_last.pop(request_id, None)
        if self.snapshots is not None:
            self.snapshots.release(request_id)
        if finished:
            self.drafter.finish(request_id)
