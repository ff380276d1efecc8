"""What the engine hands back to users, in vLLM's shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from tokenmill.kv_connector.handover.messages import HandoverIn, HandoverOffer, HandoverStats
from tokenmill.platforms.kv_tier import TierStats
from tokenmill.platforms.step import Logprobs
from tokenmill.sampling_params import SamplingParams


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the distribution
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the sampled/actual token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    # prefill/decode disaggregation: a prefill-only request's lease (its KV, held for a
    # decode engine), and whether a handed-over request's pull has ended (its prefill
    # engine's lease can be released)
    kv_offer: HandoverOffer | None = None
    kv_pulled: bool = False


# ---- what crosses between the engine core and its frontend ------------------------------
# Plain msgspec structs (never pickle): the frontend sends requests in, the engine core
# sends back per-step deltas, new tokens only. See core/engine/engine_core.py.


class EngineCoreRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    """One sequence for the engine core to run. n > 1 is fanned out by the frontend into
    one of these per child (`params.n == 1`, the child's own seed)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    # the conversation it belongs to (KV offload keeps a session's blocks for its return)
    session_id: str | None = None
    # prefill/decode disaggregation: compute the prompt and one token, keep the KV under
    # a lease (prefill engine); or continue a prefill engine's request (decode engine)
    handover_out: bool = False
    handover_in: HandoverIn | None = None
    # a decode engine leases the longest cached prefix of the prompt for the prefill
    # engine of the conversation's next turn to pull; its one delta carries the offer
    lease_prefix: bool = False


class EngineCoreSessionHint(msgspec.Struct, tag="hint", array_like=True):
    """The session's last turn ended in a tool call: it will be back soon (KV offload
    prefetches its blocks into the fastest tier when the next turn arrives)."""

    session_id: str


class EngineCoreAbort(msgspec.Struct, tag="abort", array_like=True):
    """Finish these sequences (a client that left, a stop string the frontend found)."""

    request_ids: list[str]


class EngineCoreRelease(msgspec.Struct, tag="release", array_like=True):
    """Decode engines are done with these handover leases (P/D disaggregation): free
    their KV (unknown ids are skipped)."""

    lease_ids: list[str]


class EngineCoreShutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Stop the step loop; the engine process exits."""


class EngineCoreSleep(msgspec.Struct, tag="sleep", array_like=True):
    """Enter sleep mode at `level` (1 or 2, `LLMEngine.sleep`), or leave it (0: wake up).
    The core answers with an `EngineCoreSleepState`."""

    level: int


EngineCoreInput = (
    EngineCoreRequest | EngineCoreAbort | EngineCoreSessionHint | EngineCoreShutdown
    | EngineCoreSleep | EngineCoreRelease
)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step did to one sequence: only what is new since the last delta.

    `finish_reason` is set on the sequence's last delta ("stop", "length", "abort" or
    "error"); "error" carries the cause in `stop_reason`. An add the engine refused comes
    back as a first and last delta with `finish_reason="error"` and `add_error` naming the
    kind ("value" or "structured_output"). `num_cached_tokens` is the prefix-cache hit,
    -1 until the sequence is first scheduled. `new_prompt_logprobs` extend the prompt's
    (position 0 has none: the frontend starts that list with None).
    """

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[Logprobs] | None = None
    new_prompt_logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = -1
    add_error: str | None = None
    kv_offer: HandoverOffer | None = None  # the last delta of a prefill-only request
    kv_pulled: bool = False  # a handed-over request's pull ended (release its lease)


class SpecDecodeStats(msgspec.Struct, array_like=True, frozen=True):
    """Speculative decoding's cumulative counters (core/spec_decode/)."""

    method: str
    num_drafts: int = 0  # verifications (a request's drafts in one step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = msgspec.field(default_factory=list)


class SchedulerStats(msgspec.Struct, array_like=True, frozen=True):
    """The engine core's state after a step (what /metrics shows)."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    # KV offload: tier name -> its counters, in stack order; empty without offload
    kv_tiers: dict[str, TierStats] = msgspec.field(default_factory=dict)
    # attention type ("full", "sliding_window", "linear") -> KV blocks live requests hold:
    # the arena's split between the types, which moves with the workload
    kv_blocks_by_type: dict[str, int] = msgspec.field(default_factory=dict)
    kv_blocks_usable: int = 0  # blocks the pool can hand out
    spec: SpecDecodeStats | None = None  # speculative decoding's counters; None: off
    handover: HandoverStats | None = None  # P/D disaggregation's counters; None: off
    # the roofline (tokenmill.planner.roofline): the last step's model FLOP/s and the bytes/s
    # it had to move, every rank together, and their fractions of the platform's peaks
    model_flops_per_s: float = 0.0
    flops_utilization: float = 0.0
    model_bytes_per_s: float = 0.0
    bandwidth_utilization: float = 0.0
    model_flops_total: float = 0.0  # since start
    model_bytes_total: float = 0.0


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True, gc=False):
    """One step's deltas, and the scheduler's state after it."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None


class EngineCoreReady(msgspec.Struct, tag="ready", array_like=True):
    """The engine process loaded its model; what the frontend needs to validate prompts."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    chat_template: str | None = None
    # P/D disaggregation: the engine's handover endpoint (msgpack `EngineEndpoint`)
    kv_endpoint: bytes | None = None


class EngineCoreDead(msgspec.Struct, tag="dead", array_like=True):
    """The engine process failed (at start or in its step loop) and is exiting."""

    error: str


class EngineCoreSleepState(msgspec.Struct, tag="sleep_state", array_like=True):
    """The reply to an `EngineCoreSleep`: the sleep level now (0: awake) and, when the core
    refused the change (requests in flight, already asleep...), why."""

    level: int
    error: str | None = None


EngineCoreMessage = EngineCoreOutputs | EngineCoreReady | EngineCoreDead | EngineCoreSleepState
