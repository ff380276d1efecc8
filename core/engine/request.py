"""One request's state as the scheduler and KV manager see it (pure Python)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.kv.hashing import BlockHash
from tokenmill.kv_connector.handover.messages import HandoverIn
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_KV = "waiting_for_kv"  # blocks allocated, the KV connector loading into them
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine could not continue this request (see stop_reason)

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclass(slots=True, eq=False)
class Request:
    """A sequence to run: prompt, generated tokens and how far the KV has caught up.

    The one invariant the scheduler works towards: `num_computed_tokens` catches up with
    `num_tokens`; each time it does, the model samples one more token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    session_id: str | None = None  # an agent session / user: KV offload prefetches by it
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until scheduled
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    seed: int | None = None  # this sequence's sampling seed (params.seed + child index)
    first_token_time: float | None = None
    # prefill/decode disaggregation (core/kv_connector/handover/): `handover_out` computes
    # the prompt, samples one token and keeps its KV under a lease for a decode engine;
    # `handover_in` continues a prefill engine's request from its pulled KV
    handover_out: bool = False
    handover_in: HandoverIn | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def extra_keys(self) -> tuple[tuple[str, str], ...]:
        """Tagged keys mixed into the first block's hash (isolation between tenants)."""
        return (("salt", self.cache_salt),) if self.cache_salt else ()

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
