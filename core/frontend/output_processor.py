"""After each step, in two halves that may live in different processes (as in vLLM v1).

- `CoreOutputProcessor` (engine core side): appends each sampled token to its sequence,
  feeds structured output, checks the token-level stops (EOS, stop_token_ids, max_tokens,
  min_tokens, the context length) and describes the step as `EngineCoreOutput` deltas:
  new token ids and logprobs only, never text, never a whole output.
- `OutputProcessor` (frontend side): fans a request out into its n sequences, turns the
  deltas into text with an incremental detokenizer, checks stop strings, and builds the
  cumulative `RequestOutput`s users see. A stop string ends a sequence here; the caller
  then aborts it in the engine core (`Processed.abort_ids`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.frontend.detokenizer import IncrementalDetokenizer, find_stop
from tokenmill.frontend.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    EngineCoreRequest,
    Logprob,
    PositionLogprobs,
    RequestOutput,
)
from tokenmill.kv_connector.handover.messages import HandoverOffer
from tokenmill.platforms.step import Logprobs, StepResult
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured import StructuredOutputError
from tokenmill.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

ADD_ERROR_STRUCTURED = "structured_output"
ADD_ERROR_VALUE = "value"


def check_prompt(
    token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """Raise ValueError naming the problem if this prompt can never run."""
    if not token_ids:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens; the model's context is "
            f"{max_model_len} (max_model_len), which leaves no room to generate"
        )
    max_tokens = params.max_tokens or 0
    if len(token_ids) + max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({len(token_ids)} tokens) plus max_tokens ({max_tokens}) is "
            f"{len(token_ids) + max_tokens}, over the context of {max_model_len} tokens"
        )


def add_error_kind(error: ValueError) -> str:
    return ADD_ERROR_STRUCTURED if isinstance(error, StructuredOutputError) else ADD_ERROR_VALUE


class CoreOutputProcessor:
    """The engine core's half: token-level bookkeeping, no tokenizer."""

    def __init__(
        self,
        scheduler: Scheduler,
        max_model_len: int,
        structured: StructuredOutputManager | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.structured = structured
        # sequence id -> prompt positions whose logprobs were reported; only sequences that
        # asked for them. A preempted sequence recomputes positions it already reported.
        self._prompt_lps_done: dict[str, int] = {}

    def add(self, request: Request) -> None:
        if request.sampling_params.prompt_logprobs is not None:
            self._prompt_lps_done[request.request_id] = 0

    def finish(self, request_id: str, status: RequestStatus) -> bool:
        """End a sequence and free what it holds; False if it was unknown or done."""
        self._prompt_lps_done.pop(request_id, None)
        if self.structured is not None:
            self.structured.remove_request(request_id)
        return self.scheduler.finish(request_id, status) is not None

    def fail_all(self, reason: str) -> list[EngineCoreOutput]:
        """Finish every sequence in flight with FINISHED_ERROR and `reason` (the workers
        cannot continue them); their last deltas."""
        deltas = []
        for rid in list(self.scheduler.requests):
            self.finish(rid, RequestStatus.FINISHED_ERROR)
            deltas.append(EngineCoreOutput(
                rid, finish_reason=RequestStatus.FINISHED_ERROR.value, stop_reason=reason
            ))
        return deltas

    def process(self, result: StepResult) -> list[EngineCoreOutput]:
        """Apply one step's results; a delta for every sequence the step changed."""
        deltas: dict[str, EngineCoreOutput] = {}
        for rid, (start, lps) in result.prompt_logprobs.items():
            done = self._prompt_lps_done.get(rid)
            if done is None:
                continue
            # entry j + 1 of the frontend's list scores prompt position j
            fresh = lps[max(0, done - start) :]
            if fresh:
                self._prompt_lps_done[rid] = max(done, start + len(lps))
                deltas[rid] = EngineCoreOutput(rid, new_prompt_logprobs=list(fresh))
        for rid, token_id in result.sampled_token_ids.items():
            request = self.scheduler.requests.get(rid)
            if request is None:  # aborted during the step
                continue
            delta = deltas.get(rid)
            if delta is None:
                delta = deltas[rid] = EngineCoreOutput(rid, new_token_ids=[])
            # speculative decoding: the accepted drafts come first, then the sampled token
            tokens = [*result.accepted_token_ids.get(rid, ()), token_id]
            lps = [*result.accepted_logprobs.get(rid, ()), result.logprobs.get(rid)]
            if len(lps) != len(tokens):  # logprobs were not asked for
                lps = [None] * len(tokens)
            try:
                for token, lp in zip(tokens, lps, strict=True):
                    self._append(request, delta, token, lp)
                    if delta.finish_reason is not None:
                        break  # a stop among the accepted drafts: the rest is dropped
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                # A bug or a pathological output ends this request with an error; the step
                # and every other request go on.
                logger.exception("request %s failed while processing its output", rid)
                delta.stop_reason = f"internal error: {type(e).__name__}: {e}"
                if delta.finish_reason is None:
                    delta.finish_reason = RequestStatus.FINISHED_ERROR.value
                    self.finish(rid, RequestStatus.FINISHED_ERROR)
        return list(deltas.values())

    def _append(
        self, request: Request, delta: EngineCoreOutput, token_id: int, logprobs: Logprobs | None
    ) -> None:
        """One sampled token of one sequence: record it, then check the token-level stops."""
        rid = request.request_id
        request.append_output_token(token_id)
        delta.new_token_ids.append(token_id)
        if request.num_output_tokens == 1:
            delta.num_cached_tokens = request.num_cached_tokens
        if logprobs is not None and request.sampling_params.logprobs is not None:
            if delta.new_logprobs is None:
                delta.new_logprobs = []
            delta.new_logprobs.append(logprobs)
        grammar_ended = False
        if self.structured is not None and rid in self.structured:
            error = self.structured.accept(rid, token_id)
            if error is not None:
                delta.stop_reason = f"structured output: {error}"
                self._end(delta, RequestStatus.FINISHED_ERROR)
                return
            grammar_ended = self.structured.is_ended(rid)
        status, delta.stop_reason = self._check_stop(request, token_id, grammar_ended)
        if status is not None:
            self._end(delta, status)

    def _check_stop(
        self, request: Request, token_id: int, grammar_ended: bool
    ) -> tuple[RequestStatus | None, int | None]:
        """(status, stop_reason) after `token_id`. `grammar_ended`: the structured output
        constraint is complete; an EOS then stops it even with ignore_eos or below
        min_tokens. Stop strings are the frontend's: they need text."""
        params = request.sampling_params
        if grammar_ended and token_id in params.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in params.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token_id
        if (
            params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        ) or request.num_tokens >= self.max_model_len or request.handover_out:
            return RequestStatus.FINISHED_LENGTH, None  # a prefill-only request: its one token
        return None, None

    def _end(self, delta: EngineCoreOutput, status: RequestStatus) -> None:
        delta.finish_reason = status.value
        request = self.scheduler.requests.get(delta.request_id)
        if request is not None and request.handover_out and self.scheduler.handover is not None \
                and status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            # prefill/decode disaggregation: the KV stays, under a lease, for a decode engine
            self._prompt_lps_done.pop(delta.request_id, None)
            if self.structured is not None:
                self.structured.remove_request(delta.request_id)
            last_lp = delta.new_logprobs[-1] if delta.new_logprobs else None
            delta.kv_offer = self.scheduler.hold_for_handover(request, last_lp)
            return
        self.finish(delta.request_id, status)

    def first_token(self, request: Request) -> EngineCoreOutput:
        """A request handed over by a prefill engine (`request.handover_in`): the token that
        engine sampled is this sequence's first, with every token-level stop checked (it
        may end the request at once). Call before the request is scheduled."""
        offer = request.handover_in.offer
        request.num_cached_tokens = offer.num_cached_tokens
        delta = EngineCoreOutput(request.request_id, new_token_ids=[])
        self._append(request, delta, offer.first_token, offer.first_logprobs)
        return delta


# ---- the frontend's half -----------------------------------------------------------------
@dataclass(slots=True)
class _SeqState:
    """Per child sequence: its text so far and the logprobs it collected."""

    request_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _ParentState:
    """One user request: n child sequences that share the prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, _SeqState]
    prompt_logprobs: list[PositionLogprobs | None] | None
    num_cached_tokens: int = 0
    seqs: list[_SeqState] = field(default_factory=list)
    kv_offer: HandoverOffer | None = None  # a prefill-only request's lease (disaggregation)
    kv_pulled: bool = False  # a handed-over request's KV arrived (or its pull ended)


@dataclass(slots=True)
class Processed:
    """What one batch of deltas made: outputs for the parents it changed, sequences the
    engine core must abort (a stop string or a frontend failure ended them), and parents
    whose add the engine refused (their error; no output is built for them)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    abort_ids: list[str] = field(default_factory=list)
    add_errors: dict[str, ValueError] = field(default_factory=dict)


class OutputProcessor:
    """The frontend's half: text, stop strings, logprobs with their text, outputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.child_to_parent: dict[str, str] = {}
        self._token_text: dict[int, str] = {}  # token id -> its text alone (logprobs)

    def add(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[EngineCoreRequest]:
        """Track a request; returns the engine core requests for its n sequences (child i
        gets seed + i; only the first computes prompt logprobs)."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        state = _ParentState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            children={},
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        core_requests = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None,
            )
            want_lp = params.logprobs is not None
            seq = _SeqState(
                request_id=rid,
                index=i,
                params=params,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.skip_special_tokens
                ),
                logprobs=[] if want_lp else None,
                cumulative_logprob=0.0 if want_lp else None,
            )
            state.children[rid] = seq
            state.seqs.append(seq)
            self.child_to_parent[rid] = request_id
            core_requests.append(EngineCoreRequest(rid, list(prompt_token_ids), child_params))
        self.parents[request_id] = state
        return core_requests

    def child_ids(self, request_id: str) -> list[str]:
        state = self.parents.get(request_id)
        return list(state.children) if state else []

    def process(self, deltas: list[EngineCoreOutput]) -> Processed:
        """Apply one step's deltas; sequences of unknown or finished requests are ignored
        (the engine core may run one more step for a sequence a stop string ended)."""
        done = Processed()
        touched: dict[str, _ParentState] = {}
        for delta in deltas:
            parent_id = self.child_to_parent.get(delta.request_id)
            if parent_id is None:
                continue
            parent = self.parents[parent_id]
            seq = parent.children[delta.request_id]
            if seq.finish_reason is not None:
                continue
            if delta.add_error is not None:
                self._fail_add(parent, delta, done)
                continue
            touched[parent_id] = parent
            try:
                self._apply(parent, seq, delta)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                logger.exception("request %s failed while processing its output", delta.request_id)
                seq.stop_reason = f"internal error: {type(e).__name__}: {e}"
                seq.finish_reason = RequestStatus.FINISHED_ERROR.value
            if seq.finish_reason is not None and delta.finish_reason is None:
                done.abort_ids.append(seq.request_id)
        done.outputs = [self._build(p) for p in touched.values() if p.request_id in self.parents]
        return done

    def _fail_add(self, parent: _ParentState, delta: EngineCoreOutput, done: Processed) -> None:
        message = str(delta.stop_reason)
        error_cls = StructuredOutputError if delta.add_error == ADD_ERROR_STRUCTURED else ValueError
        done.add_errors[parent.request_id] = error_cls(message)
        for seq in parent.seqs:
            if seq.finish_reason is None and seq.request_id != delta.request_id:
                done.abort_ids.append(seq.request_id)
        self._forget(parent)

    def _apply(self, parent: _ParentState, seq: _SeqState, delta: EngineCoreOutput) -> None:
        if delta.new_prompt_logprobs and parent.prompt_logprobs is not None:
            parent.prompt_logprobs.extend(self._convert(lp) for lp in delta.new_prompt_logprobs)
        if delta.num_cached_tokens > 0 and parent.num_cached_tokens == 0:
            parent.num_cached_tokens = delta.num_cached_tokens
        if delta.kv_offer is not None:
            parent.kv_offer = delta.kv_offer
        parent.kv_pulled = parent.kv_pulled or delta.kv_pulled
        new_ids = delta.new_token_ids
        if new_ids:
            seq.token_ids.extend(new_ids)
            if seq.logprobs is not None and delta.new_logprobs:
                for token_id, raw in zip(new_ids, delta.new_logprobs):
                    lp = self._convert(raw)
                    seq.logprobs.append(lp)
                    seq.cumulative_logprob += lp[token_id].logprob
            new_text = seq.detokenizer.append(new_ids)
            seq.text += new_text
            if (
                seq.params.stop
                and new_text
                and delta.finish_reason in (None, RequestStatus.FINISHED_LENGTH.value)
                and len(seq.token_ids) >= seq.params.min_tokens
            ):
                found = find_stop(
                    seq.text, len(new_text), seq.params.stop, seq.params.include_stop_str_in_output
                )
                if found is not None:
                    seq.stop_reason, cut = found
                    seq.text = seq.text[:cut]
                    seq.finish_reason = RequestStatus.FINISHED_STOPPED.value
                    return
        if delta.finish_reason is not None:
            seq.finish_reason = delta.finish_reason
            seq.stop_reason = delta.stop_reason

    def abort(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """Finish every child of a parent as aborted: its final output (None if unknown)
        and the sequences the engine core must abort."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None, []
        abort_ids = []
        for seq in parent.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = RequestStatus.FINISHED_ABORTED.value
                abort_ids.append(seq.request_id)
        return self._build(parent), abort_ids

    def _convert(self, lp: Logprobs) -> PositionLogprobs:
        return {
            tid: Logprob(logprob=v, rank=r, decoded_token=self._text_of(tid))
            for tid, v, r in zip(lp.token_ids, lp.logprobs, lp.ranks)
        }

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _forget(self, parent: _ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for rid in parent.children:
            self.child_to_parent.pop(rid, None)

    def _build(self, parent: _ParentState) -> RequestOutput:
        finished = all(s.finish_reason is not None for s in parent.seqs)
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=seq.text,
                token_ids=list(seq.token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=seq.logprobs,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in parent.seqs
        ]
        if finished:
            self._forget(parent)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
            kv_offer=parent.kv_offer,
            kv_pulled=parent.kv_pulled,
        )
