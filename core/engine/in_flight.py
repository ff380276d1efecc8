"""The engine's queue of steps in flight (pipeline parallel), and what each may change.

A step's sampled tokens are applied when it is collected, which can be after the
scheduler moved on: a request of the step may have finished, been aborted, or been
preempted (its KV freed, to be recomputed from scratch) meanwhile. `current` keeps the
results of requests that are still the ones the step computed for: same id, same number
of preemptions. Plain Python; no device import.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.platforms.step import StepResult


@dataclass(slots=True)
class InFlightStep:
    plan: SchedulerOutput
    handle: Any  # the executor's, for `collect`
    # request id -> its num_preemptions when the step was submitted
    epochs: dict[str, int] = field(default_factory=dict)

    def current(self, result: StepResult, requests: dict[str, Request]) -> StepResult:
        """`result` without the requests that ended or were preempted since submission."""
        def live(rid: str) -> bool:
            request = requests.get(rid)
            return (
                request is not None and request.status == RequestStatus.RUNNING
                and request.num_preemptions == self.epochs.get(rid)
            )

        if all(live(rid) for rid in (*result.sampled_token_ids, *result.prompt_logprobs)):
            return result
        return StepResult(
            sampled_token_ids={r: t for r, t in result.sampled_token_ids.items() if live(r)},
            logprobs={r: lp for r, lp in result.logprobs.items() if live(r)},
            prompt_logprobs={r: lp for r, lp in result.prompt_logprobs.items() if live(r)},
            kv_connector=result.kv_connector,
        )


class InFlightSteps:
    """At most `depth` submitted steps, collected oldest first. Counts how many steps
    were submitted while another was in flight (the pipeline overlapped them), and how
    many of those carried the next chunk of a prompt whose previous chunk was in flight
    (chunked prefill split across the stages)."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"a pipeline depth of {depth} holds no step")
        self.depth = depth
        self._queue: deque[InFlightStep] = deque()
        self.num_submitted = 0
        self.num_overlapped = 0  # submitted with another step already in flight
        self.num_chunks_overlapped = 0  # ... holding a request of a step in flight

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def full(self) -> bool:
        return len(self._queue) >= self.depth

    def push(self, plan: SchedulerOutput, handle: Any, requests: dict[str, Request]) -> None:
        epochs = {s.request_id: requests[s.request_id].num_preemptions for s in plan.scheduled}
        self.num_submitted += 1
        self.num_overlapped += bool(self._queue)
        self.num_chunks_overlapped += any(rid in e.epochs for e in self._queue for rid in epochs)
        self._queue.append(InFlightStep(plan, handle, epochs))

    def pop(self) -> InFlightStep:
        return self._queue.popleft()

    def clear(self) -> None:
        self._queue.clear()
