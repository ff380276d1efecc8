"""The engine core's half of speculative decoding: drafts for decoding requests, how
many of them to send (spec_decode.adaptive), and the counters /metrics shows.

Model-free methods (ngram, suffix) propose from token ids alone, here. Each request's
index catches up with its tokens lazily when it is asked for drafts, so nothing needs
to tell the drafter about appended tokens; `finish` drops a request's state.
Model-based methods (mtp, eagle3) draft on the workers (core/worker/drafting.py): each
step's result brings the drafts that follow a request's tokens (`receive`), and they are
proposed at the next step if the request still has exactly those tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.engine.request import Request
from tokenmill.frontend.outputs import SpecDecodeStats
from tokenmill.spec_decode.adaptive import AdaptivePlanner
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramIndex
from tokenmill.spec_decode.suffix import SuffixDecodingCache

logger = logging.getLogger(__name__)

MODEL_FREE = ("ngram", "suffix")
MODEL_BASED = ("mtp", "eagle3")


@dataclass(slots=True)
class SpecStats:
    """Cumulative counters of one engine (what /metrics exports)."""

    num_drafts: int = 0  # verifications: steps x requests that sent drafts
    num_draft_tokens: int = 0  # draft tokens sent
    num_accepted_tokens: int = 0  # of those, accepted
    # accepted tokens by draft position (1-based index - 1)
    accepted_per_position: list[int] = field(default_factory=list)

    def snapshot(self, method: str) -> SpecDecodeStats:
        return SpecDecodeStats(method, self.num_drafts, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.accepted_per_position))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: accepted drafts + the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Drafter:
    """Drafts for the scheduler: a model-free proposer's (`config.method` ngram or
    suffix), or the workers' draft model's (mtp, eagle3)."""

    def __init__(self, config: SpeculativeConfig,
                 cost_prior: tuple[tuple[int, float], ...] = ()) -> None:
        """`cost_prior`: (tokens, seconds) of decode steps from the platform's roofline
        (spec_decode.adaptive)."""
        if config.method not in MODEL_FREE + MODEL_BASED:
            raise ValueError(f"unknown speculative method {config.method!r}; use one of "
                             f"{MODEL_FREE + MODEL_BASED}")
        self.config = config
        self.method = config.method
        self.stats = SpecStats()
        self.planner = AdaptivePlanner(enabled=config.adaptive)
        self.planner.cost.prior = cost_prior
        # set by the engine: cuts drafts a structured-output constraint refuses
        self.validate: Callable[[str, list[int]], list[int]] | None = None
        self._ngrams: dict[str, NgramIndex] = {}
        self._suffix = (
            SuffixDecodingCache(config.suffix_decoding_max_tree_depth,
                                config.suffix_decoding_max_cached_requests)
            if config.method == "suffix" else None
        )
        self._seen: dict[str, int] = {}  # request id -> tokens its index holds
        # model-based: request id -> (its token count they follow, the workers' drafts)
        self._received: dict[str, tuple[int, list[int]]] = {}

    def receive(self, drafts: dict[str, list[int]], requests: dict[str, Request]) -> None:
        """A step's drafts from the workers' draft model, each following its request's
        tokens as they are now (after the step's outputs were appended)."""
        for rid, ids in drafts.items():
            request = requests.get(rid)
            if request is not None and not request.is_finished:
                self._received[rid] = (request.num_tokens, ids)

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` drafts to follow the request's tokens."""
        if max_tokens < 1:
            return []
        rid = request.request_id
        c = self.config
        tokens = request.all_token_ids
        seen = self._seen.get(rid)
        if self.method in MODEL_BASED:
            count, received = self._received.pop(rid, (-1, []))
            # stale after a preemption or a stop that cut the step's tokens
            drafts = received[: min(max_tokens, c.num_speculative_tokens)] \
                if count == request.num_tokens else []
        elif self._suffix is not None:
            if seen is None:
                self._suffix.start_request(rid, request.prompt_token_ids)
                seen = request.num_prompt_tokens
            if seen < len(tokens):
                self._suffix.add_response(rid, tokens[seen:])
            self._seen[rid] = len(tokens)
            drafts = self._suffix.speculate(
                rid, min(max_tokens, c.num_speculative_tokens),
                c.suffix_decoding_max_spec_factor, c.suffix_decoding_max_spec_offset,
                c.suffix_decoding_min_token_prob,
            ).token_ids
        else:
            index = self._ngrams.get(rid)
            if index is None:
                index = self._ngrams[rid] = NgramIndex()
                seen = 0
            index.extend(tokens[seen:])
            self._seen[rid] = len(tokens)
            drafts = index.propose(min(max_tokens, c.num_speculative_tokens),
                                   c.prompt_lookup_min, c.prompt_lookup_max)
        if drafts and self.validate is not None:
            drafts = self.validate(rid, drafts)
        return drafts

    def plan(self, proposals: dict[str, list[int]], num_rows: int) -> dict[str, list[int]]:
        """The drafts each request sends this step (a prefix of its proposal)."""
        counts = self.planner.plan(proposals, num_rows)
        return {rid: proposals[rid][:n] for rid, n in counts.items() if n}

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.planner.cost.observe(num_tokens, seconds)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        if len(s.accepted_per_position) < num_drafts:
            s.accepted_per_position += [0] * (num_drafts - len(s.accepted_per_position))
        for i in range(num_accepted):
            s.accepted_per_position[i] += 1
        self.planner.record(request_id, num_drafts, num_accepted)

    def finish(self, request_id: str) -> None:
        """The request ended: drop its index (suffix: its output stays in the global tree)."""
        self._seen.pop(request_id, None)
        self._received.pop(request_id, None)
        self._ngrams.pop(request_id, None)
        if self._suffix is not None:
            self._suffix.stop_request(request_id)
        self.planner.forget(request_id)
