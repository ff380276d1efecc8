"""The scheduler's part in prefill/decode disaggregation (core/kv_connector/handover/):
admitting a request whose prompt a prefill engine computed, applying the workers' pull
reports, and, on a prefill engine, holding a request's KV under a lease once it sampled
its first token. A mixin of `Scheduler` (its queues, KV manager and worker view)."""

from __future__ import annotations

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.kv_connector.handover.messages import HandoverOffer
from tokenmill.platforms.kv_handover import HandoverReport
from tokenmill.platforms.step import Logprobs


class SchedulerHandover:
    """Methods `Scheduler` gets for the handover; `self.handover` is its
    `HandoverScheduler` (None: no disaggregation)."""

    def _admit_handover(self, request: Request) -> bool:
        """Admit a request whose prompt a prefill engine computed: its KV is pulled in the
        background (WAITING_FOR_KV). False: its blocks do not fit now."""
        if not self.handover.admit(request, self.kv):
            return False
        self.waiting.remove(request)
        request.status = RequestStatus.WAITING_FOR_KV
        self.loading[request.request_id] = request
        return True

    def update_from_handover(self, report: HandoverReport | None) -> list[str]:
        """Apply the workers' pull report: a pulled request runs on from its whole prompt;
        one whose pull failed computes its prompt here, admitted again as any request.
        Returns the ids whose pulls ended (their prefill engine's lease can go)."""
        ended = []
        for request, result in self.handover.process(report) if self.handover else ():
            rid = request.request_id
            ended.append(rid)
            parked = self.parked.pop(rid, None)
            if parked is not None:
                self.kv.free(parked)
                continue
            self.loading.pop(rid, None)
            if result.ok:
                offer = request.handover_in.offer
                pulled = offer.num_tokens if offer.prefix else request.num_prompt_tokens
                self.kv.cache_blocks(request, pulled)
                request.num_computed_tokens = pulled
                if offer.prefix:  # the rest of the prompt is computed here
                    request.num_cached_tokens = pulled
                    self.kv.record_lookup(request.num_tokens, pulled)
                request.handover_in = None  # pulled: a preemption recomputes from here
                request.status = RequestStatus.RUNNING
                self.running.append(request)
            else:
                self.kv.free(request)
                request.handover_in = None
                request.status = RequestStatus.WAITING
                self.waiting.appendleft(request)
        return ended

    def hold_for_handover(self, request: Request, logprobs: Logprobs | None) -> HandoverOffer:
        """A prefill-only request sampled its first token: it leaves the scheduler but its
        KV stays allocated under a lease (`release_handover`)."""
        del self.requests[request.request_id]
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_LENGTH
        self._forget_drafts(request.request_id, finished=True)
        self.workers.forget(request.request_id, False)
        return self.handover.hold(request, self.kv, logprobs)

    def lease_prefix(self, lease_id: str, token_ids: list[int],
                     cache_salt: str | None = None) -> HandoverOffer | None:
        """Lease the longest cached prefix of `token_ids` for another engine to pull (an
        agent's next turn, whose prefill engine pulls turn N's KV back from here); None:
        nothing cached. `release_handover` (or the lease's timeout) gives it back."""
        held = self.handover.hold_prefix(lease_id, token_ids, self.kv, cache_salt)
        return None if held is None else held[0]

    def release_handover(self, lease_id: str) -> bool:
        """The decode engine is done with `lease_id`: its KV goes back (False: unknown)."""
        request = self.handover.release(lease_id) if self.handover else None
        if request is not None:
            self.kv.free(request)
        return request is not None

    def expire_handovers(self) -> None:
        """Free the KV of leases no decode engine released in time."""
        if self.handover is not None and self.handover.num_leases:
            for request in self.handover.expire():
                self.kv.free(request)
