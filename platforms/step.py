"""The step description the engine core hands to the workers, and the result they return.

Plain, schema'd data (msgspec Structs): it crosses process boundaries (the "mp" executor
sends it over ZMQ, msgpack-encoded) and is the input of every model runner, the core's
and a plugin's own (`platforms.interfaces.ModelRunnerBase`). A worker never looks
anything up in the scheduler: what it needs about a request arrives once, in a
`NewRequest`, and then only deltas (`CachedRequest`). The worker keeps the per-request
state (token ids, sampling parameters, generator, block table) in its own table
(`tokenmill.platforms.kit.runner_state.RequestStateTable`), updated from each step in this order:
finished, aborted and preempted ids are dropped, new requests added, cached ones
advanced; then the batch is `scheduled_request_ids` with `num_scheduled_tokens`.

A request samples in a step iff the step completes the tokens known for it:
`num_computed_tokens + num_scheduled == len(prompt) + len(outputs)` on the worker's table.
Sampling rows are the sampling requests in batch order.

This module imports nothing but msgspec, so the scheduler stays free of any device library.
"""

from __future__ import annotations

import msgspec

from tokenmill.platforms.kv_handover import HandoverReport, HandoverStepMeta
from tokenmill.platforms.kv_messages import ConnectorStepMeta, WorkerReport

_GREEDY_EPS = 1e-5  # as SamplingParams: a temperature below this is greedy


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the sampler needs of a request's `SamplingParams` (stop strings, detokenizing
    and structured-output grammars stay with the engine core)."""

    temperature: float = 1.0  # 0 (below 1e-5): greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # over prompt + output tokens; 1: off
    presence_penalty: float = 0.0  # over output tokens; 0: off
    frequency_penalty: float = 0.0  # over output tokens; 0: off
    min_tokens: int = 0  # stop and eos ids are masked until this many outputs exist
    stop_token_ids: list[int] = []  # token ids, masked below min_tokens
    eos_token_ids: list[int] = []  # token ids, masked below min_tokens unless ignore_eos
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per sampled token (+ the sampled one); None: none
    prompt_logprobs: int | None = None  # top logprobs per prompt position; None: none
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit; None: none

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


class NewRequest(msgspec.Struct, frozen=True):
    """A request the worker has not seen, or sees again after a preemption."""

    request_id: str
    prompt_token_ids: list[int]  # [num_prompt_tokens]
    # [num_output_tokens]: tokens generated so far; non-empty for a preempted request that
    # resumes (its KV is recomputed, its generator replayed past these draws)
    output_token_ids: list[int]
    sampling: SamplingSpec
    seed: int | None  # the request's own generator seed; None: the worker's global RNG
    block_ids: list[int]  # [num_blocks]: the request's whole block table (KV group 0's)
    num_computed_tokens: int  # tokens already in the KV cache (a prefix-cache hit)
    # the whole block tables of KV groups 1, 2, ... (hybrid models: one table per group of
    # layers of one attention type); entries a sliding window no longer reads hold block 0
    extra_block_ids: list[list[int]] = []


class CachedRequest(msgspec.Struct, frozen=True):
    """A request the worker already holds: what changed since the last step it was in."""

    request_id: str
    new_token_ids: list[int]  # [n]: tokens appended since the worker last saw it (outputs)
    new_block_ids: list[int]  # [m]: blocks appended to its block table
    num_computed_tokens: int  # tokens in the KV cache before this step
    # blocks appended to the tables of KV groups 1, 2, ... (tables only grow: an entry a
    # sliding window stops reading is not sent again, and is never read)
    extra_new_block_ids: list[list[int]] = []
    # speculative decoding gave back blocks only rejected drafts wrote: when non-empty,
    # each group's table (group order) is first cut to this many entries, then the new
    # block ids are appended
    block_table_lens: list[int] = []


class RecurrentStateOps(msgspec.Struct, frozen=True):
    """What a step does with one request's state in one KV group of LINEAR layers, beyond
    reading and writing its slot (the group's block table; core/kv/recurrent.py)."""

    group_id: int  # the KV group (0 is `block_ids`' group, g >= 1 is extra_block_ids[g - 1])
    # a prefix-cache hit's checkpoint: the state before this step's first token is read
    # from these pages (never written) instead of the slot; empty: the slot, or zeros at
    # token 0
    restore_block_ids: list[int] = []
    # (n, pages): write the state after the request's first n tokens (n within this
    # step's tokens, ascending) into pages: prefix-cache checkpoints
    checkpoints: list[tuple[int, list[int]]] = []


class StructuredMasks(msgspec.Struct, frozen=True):
    """Structured output's token bitmask for some sampling rows of this step."""

    # int32 [len(row_indices), num_words] little-endian, row-major: bit j of word w allows
    # token 32 * w + j (numpy.frombuffer(bitmask, "<i4").reshape(-1, num_words))
    bitmask: bytes
    num_words: int  # ceil(vocab / 32)
    row_indices: list[int]  # [rows]: the sampling row each mask row applies to
    ended_rows: list[int]  # sampling rows whose constraint is complete: only EOS is allowed


class StepDescription(msgspec.Struct, kw_only=True):
    """One engine step, complete: everything the workers need and nothing to look up."""

    step_id: int  # counts the engine's steps from 0; for logs and ordering checks
    new_requests: list[NewRequest] = []
    cached_requests: list[CachedRequest] = []
    # batch order: request i computes num_scheduled_tokens[i] tokens from its
    # num_computed_tokens on
    scheduled_request_ids: list[str] = []  # [num_scheduled]
    num_scheduled_tokens: list[int] = []  # [num_scheduled]
    finished_request_ids: list[str] = []  # stopped or at length since the last step
    aborted_request_ids: list[str] = []  # aborted or failed since the last step
    preempted_request_ids: list[str] = []  # preempted this step: drop their state and blocks
    # request id -> prompt positions [start, end) whose next-token logprobs are wanted
    prompt_logprob_ranges: dict[str, tuple[int, int]] = {}
    structured: StructuredMasks | None = None  # None: no sampling row is constrained
    # KV offload: loads to start and blocks to save after the forward pass (None: no
    # connector). A step may carry only this, with no scheduled request (loads in flight).
    kv_connector: ConnectorStepMeta | None = None
    # request id -> its recurrent-state operations this step (models with LINEAR layers;
    # requests absent: read and write their slots only)
    recurrent_state: dict[str, list[RecurrentStateOps]] = {}
    # speculative decoding: request id -> draft token ids [k] verified this step. They
    # follow the request's known tokens and count in its num_scheduled_tokens (1 + k for
    # a decoding request); the worker never adds them to its token list. With drafts the
    # request's sampling positions are its last 1 + k, and `structured.row_indices` index
    # the step's sampling positions (each sampling row's 1 + k, in row order).
    spec_token_ids: dict[str, list[int]] = {}
    # P/D disaggregation (decode engines): peers to connect and pulls to start now, in
    # the background (core/kv_connector/handover/); None: none this step
    kv_handover: HandoverStepMeta | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


class Logprobs(msgspec.Struct):
    """Logprobs at one position: the chosen token first, then the top-k in rank order."""

    token_ids: list[int]  # [1 + k]
    logprobs: list[float]  # [1 + k]
    ranks: list[int]  # [1 + k]: 1-based rank of each token in the distribution


class StepResult(msgspec.Struct):
    """What one step produced; returned by rank 0's model runner."""

    # request id -> the token sampled this step, for every sampling row, in row order
    sampled_token_ids: dict[str, int] = {}
    # request id -> logprobs of its sampled token (only requests that asked for them)
    logprobs: dict[str, Logprobs] = {}
    # request id -> (start, logprobs of prompt positions [start, start + len)) this step
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = {}
    # KV offload: loads and saves the worker finished since its last report
    kv_connector: WorkerReport | None = None
    # speculative decoding: request id -> its drafts the target accepted this step, in
    # order; they come before its sampled_token_ids entry (requests with drafts only)
    accepted_token_ids: dict[str, list[int]] = {}
    # request id -> logprobs of each accepted draft (requests that asked for logprobs)
    accepted_logprobs: dict[str, list[Logprobs]] = {}
    # P/D disaggregation: pulls that ended on every rank since the last report
    kv_handover: HandoverReport | None = None
    # model-based speculative decoding (mtp, eagle3): request id -> the drafts its draft
    # model proposes to follow this step's tokens (sampling rows of the core's runner)
    draft_token_ids: dict[str, list[int]] = {}


_ENCODER = msgspec.msgpack.Encoder()
_STEP_DECODER = msgspec.msgpack.Decoder(StepDescription)
_RESULT_DECODER = msgspec.msgpack.Decoder(StepResult)


def encode(message: StepDescription | StepResult) -> bytes:
    """msgpack bytes of a step or a result (no pickle: the schema is the types above)."""
    return _ENCODER.encode(message)


def decode_step(data: bytes) -> StepDescription:
    """A `StepDescription` from its msgpack bytes (`encode`)."""
    return _STEP_DECODER.decode(data)


def decode_result(data: bytes) -> StepResult:
    """A `StepResult` from its msgpack bytes (`encode`)."""
    return _RESULT_DECODER.decode(data)
