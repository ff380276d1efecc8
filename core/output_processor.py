"""After each step: append sampled tokens, detokenize, check stop conditions, build outputs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tokenmill.detokenizer import IncrementalDetokenizer, find_stop
from tokenmill.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.scheduler import Scheduler
from tokenmill.step import Logprobs, StepResult
from tokenmill.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _SeqState:
    """Per child sequence: its text so far and the logprobs it collected."""

    index: int
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
    finished: bool = False
    seqs: list[_SeqState] = field(default_factory=list)


class OutputProcessor:
    def __init__(
        self,
        tokenizer,
        scheduler: Scheduler,
        max_model_len: int,
        structured: StructuredOutputManager | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.structured = structured
        self.max_model_len = max_model_len
        self.parents: dict[str, _ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        params = children[0].sampling_params
        state = _ParentState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=children[0].prompt_token_ids,
            children={},
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        for i, child in enumerate(children):
            want_lp = child.sampling_params.logprobs is not None
            seq = _SeqState(
                index=i,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, child.prompt_token_ids, params.skip_special_tokens
                ),
                logprobs=[] if want_lp else None,
                cumulative_logprob=0.0 if want_lp else None,
            )
            state.children[child.request_id] = seq
            state.seqs.append(seq)
            self.child_to_parent[child.request_id] = request_id
        self.parents[request_id] = state

    def child_ids(self, request_id: str) -> list[str]:
        state = self.parents.get(request_id)
        return list(state.children) if state else []

    def process(self, result: StepResult) -> list[RequestOutput]:
        """Apply one step's results; return an output for every parent that changed."""
        touched: dict[str, _ParentState] = {}
        for rid, (start, lps) in result.prompt_logprobs.items():
            parent = self.parents[self.child_to_parent[rid]]
            if parent.prompt_logprobs is not None and next(iter(parent.children)) == rid:
                # entry j + 1 scores prompt position j; a preempted request recomputes
                # positions it already reported, which are skipped here
                num_done = len(parent.prompt_logprobs) - 1
                fresh = lps[max(0, num_done - start) :]
                parent.prompt_logprobs.extend(self._convert(lp) for lp in fresh)
        for rid, token_id in result.sampled_token_ids.items():
            request = self.scheduler.requests.get(rid)
            if request is None:  # aborted during the step
                continue
            parent = self.parents[self.child_to_parent[rid]]
            seq = parent.children[rid]
            touched[parent.request_id] = parent
            try:
                self._append(request, parent, seq, token_id, result.logprobs.get(rid))
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                # A bug or a pathological output (the detokenizer, stop strings, logprobs)
                # ends this request with an error; the step and every other request go on.
                logger.exception("request %s failed while processing its output", rid)
                seq.stop_reason = f"internal error: {type(e).__name__}: {e}"
                if seq.finish_reason is None:
                    self._finish(request, seq, RequestStatus.FINISHED_ERROR)
        return [self._build(p) for p in touched.values()]

    def _append(
        self,
        request: Request,
        parent: _ParentState,
        seq: _SeqState,
        token_id: int,
        logprobs: Logprobs | None,
    ) -> None:
        """One sampled token of one sequence: record it, then check its stop conditions."""
        rid = request.request_id
        if parent.num_cached_tokens == 0 and request.num_cached_tokens > 0:
            parent.num_cached_tokens = request.num_cached_tokens
        request.append_output_token(token_id)
        seq.token_ids.append(token_id)
        if seq.logprobs is not None and logprobs is not None:
            lp = self._convert(logprobs)
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp[token_id].logprob
        grammar_ended = False
        if self.structured is not None and rid in self.structured:
            error = self.structured.accept(rid, token_id)
            if error is not None:
                seq.stop_reason = f"structured output: {error}"
                self._finish(request, seq, RequestStatus.FINISHED_ERROR)
                return
            grammar_ended = self.structured.is_ended(rid)
        self._check_stop(request, seq, token_id, grammar_ended)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish every child of a parent as aborted; returns its final output."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for rid, seq in parent.children.items():
            if seq.finish_reason is None:
                self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
                seq.finish_reason = "abort"
                if self.structured is not None:
                    self.structured.remove_request(rid)
        return self._build(parent)

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """Finish every unfinished sequence with FINISHED_ERROR and `reason` as its stop
        reason (the engine cannot continue them); returns the final outputs."""
        outputs = []
        for parent in list(self.parents.values()):
            for rid, seq in parent.children.items():
                if seq.finish_reason is not None:
                    continue
                seq.stop_reason = reason
                request = self.scheduler.requests.get(rid)
                if request is not None:
                    self._finish(request, seq, RequestStatus.FINISHED_ERROR)
                else:
                    seq.finish_reason = RequestStatus.FINISHED_ERROR.value
            outputs.append(self._build(parent))
        return outputs

    def _check_stop(
        self, request: Request, seq: _SeqState, token_id: int, grammar_ended: bool = False
    ) -> None:
        """`grammar_ended`: the request's structured output constraint is complete after
        this token; an EOS then stops it even with ignore_eos or below min_tokens."""
        params = request.sampling_params
        new_text = seq.detokenizer.append([token_id])
        seq.text += new_text
        status = None
        if grammar_ended and token_id in params.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in params.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token_id in params.stop_token_ids:
                status, seq.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
            elif params.stop and new_text:
                found = find_stop(
                    seq.text, len(new_text), params.stop, params.include_stop_str_in_output
                )
                if found is not None:
                    seq.stop_reason, cut = found
                    seq.text = seq.text[:cut]
                    status = RequestStatus.FINISHED_STOPPED
        if status is None and (
            (params.max_tokens is not None and request.num_output_tokens >= params.max_tokens)
            or request.num_tokens >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(request, seq, status)

    def _finish(self, request: Request, seq: _SeqState, status: RequestStatus) -> None:
        seq.finish_reason = status.value
        self.scheduler.finish(request.request_id, status)
        if self.structured is not None:
            self.structured.remove_request(request.request_id)

    def _convert(self, lp: Logprobs) -> PositionLogprobs:
        return {
            tid: Logprob(logprob=v, rank=r, decoded_token=self.tokenizer.decode([tid]))
            for tid, v, r in zip(lp.token_ids, lp.logprobs, lp.ranks)
        }

    def _build(self, parent: _ParentState) -> RequestOutput:
        finished = all(s.finish_reason is not None for s in parent.seqs)
        outputs = []
        for seq in parent.seqs:
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.text,
                    token_ids=list(seq.token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=seq.logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        if finished:
            self.parents.pop(parent.request_id, None)
            for rid in parent.children:
                self.child_to_parent.pop(rid, None)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
        )
