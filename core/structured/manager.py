"""The engine's structured-output component: compiles constraints, keeps one llguidance
matcher per sequence, fills each step's token bitmask and advances the matchers.

Bounds, so that no user input can stall the engine:
- compile time: each constraint is compiled in a worker thread and abandoned after
  `compile_timeout_s`; llguidance's fuel limits (`LLParserLimits`) bound the work of every
  mask step. An abandoned build runs on (a Rust build cannot be interrupted) and caches its
  outcome when it ends; a repeat meanwhile joins it, so retries never pile up builds.
- regexes: llguidance lexes with derivatives of regexes (no backtracking), so a regex such
  as `(a|aa)*b` costs linear time; too large a lexer is refused by the fuel limit.
- cache: an LRU of at most `cache_size` compiled grammars, keyed by the canonical
  constraint text; each request deep-copies a cached matcher.

Only the engine thread touches per-request state; `compile` may also run in other threads
(AsyncLLM validates constraints off the event loop before submitting a request).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch

from tokenmill.structured.params import StructuredOutputError, StructuredOutputsParams

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256
# Optional whitespace between JSON tokens, bounded: a few blanks, at most one line break
# and an indent. Unbounded (llguidance's default), a small model may spend its whole
# max_tokens on newlines inside an object it never closes; a schema's own
# `"x-guidance": {"whitespace_pattern": ...}` still wins.
BOUNDED_JSON_WHITESPACE = r"[\x20\x09]{0,4}(\x0D?\x0A[\x20\x09]{0,20})?"
DEFAULT_COMPILE_TIMEOUT_S = 5.0


@dataclass(slots=True)
class StructuredStep:
    """One step's masks, for the sampling rows that have a constraint."""

    bitmask: torch.Tensor  # int32 [len(row_indices), ceil(vocab / 32)] on the host; bit j of
    # word w allows token 32 * w + j
    row_indices: list[int]  # the sampling row (in the step's sampling order) of each mask row
    ended_rows: list[int]  # rows whose constraint is complete: only EOS is allowed


def grammar_for(params: StructuredOutputsParams) -> tuple[str, str]:
    """(cache key, llguidance grammar text) of a constraint. The key is canonical: the same
    schema written with other key order or spacing shares one cache entry.

    Raises StructuredOutputError when `json` is text that is not JSON.
    """
    kind = params.kind
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict | bool):
            raise StructuredOutputError(
                f"the JSON schema must be an object, not {type(schema).__name__}: {schema!r:.80}"
            )
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        options = ({"whitespace_flexible": False} if params.disable_any_whitespace else
                   {"whitespace_flexible": True, "whitespace_pattern": BOUNDED_JSON_WHITESPACE})
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)
        except ValueError as e:
            raise StructuredOutputError(f"invalid JSON schema: {e}") from e
        return f"json:{int(params.disable_any_whitespace)}:{text}", grammar
    if kind == "regex":
        return f"regex:{params.regex}", llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        text = json.dumps(params.choice)
        return f"choice:{text}", llguidance.grammar_from("choice", text)
    return f"grammar:{params.grammar}", llguidance.LLMatcher.grammar_from_lark(params.grammar)


class StructuredOutputManager:
    """Owned by the engine. Costs nothing per step while no request has a constraint."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        limits: llguidance.LLParserLimits | None = None,
    ) -> None:
        """`tokenizer`: the engine's HF (fast) tokenizer; `vocab_size`: the width of the
        model's logits (may exceed the tokenizer's: the extra ids are never allowed);
        `eos_token_ids`: the ids a finished constraint allows."""
        if cache_size < 1:
            raise ValueError(f"cache_size={cache_size} must be >= 1")
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s={compile_timeout_s} must be > 0")
        self.hf_tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        # verbose errors would copy the whole grammar (user data) into error messages
        self.limits = limits or llguidance.LLParserLimits(verbose_errors=False)
        self.num_words = (self.vocab_size + 31) // 32
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._building: dict[str, Future] = {}  # cache key -> its build in flight
        self._background: ThreadPoolExecutor | None = None  # compile_in_background
        self._executor: llguidance.LLExecutor | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}  # request id -> matcher
        self._bitmask = torch.empty(0, self.num_words, dtype=torch.int32)

    # ---- compiling (any thread) ----------------------------------------------------------
    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (about 0.5 s)."""
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self.hf_tokenizer, n_vocab=self.vocab_size,
                        eos_token=self.eos_token_ids or None,
                    )
                except ValueError as e:  # "Only fast tokenizers are supported"
                    raise StructuredOutputError(
                        f"structured output needs a fast (Rust) tokenizer; this model's "
                        f"{type(self.hf_tokenizer).__name__} cannot be used: {e}"
                    ) from e
            return self._tokenizer

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    @property
    def num_building(self) -> int:
        """Builds in flight (those whose callers gave up included)."""
        with self._lock:
            return len(self._building)

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher's template for `params`, from the cache or compiled now.

        Raises StructuredOutputError naming the problem when the constraint is invalid or
        compiling takes longer than `compile_timeout_s`. Invalid constraints are cached too,
        so a repeated bad request fails fast. The template is shared: callers must not
        advance it, only `deep_copy` it (as `add_request` does).
        """
        key, grammar = grammar_for(params)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            future = self._build_once(key, grammar)
            try:
                hit = future.result(timeout=self.compile_timeout_s)
            except FutureTimeout:
                raise StructuredOutputError(
                    f"compiling the {params.kind} constraint took longer than "
                    f"{self.compile_timeout_s} s; simplify it"
                ) from None
        if isinstance(hit, str):
            raise StructuredOutputError(f"invalid {params.kind} constraint: {hit}")
        return hit

    def cached(self, params: StructuredOutputsParams) -> llguidance.LLMatcher | None:
        """The compiled template for `params` if the cache has it, else None; raises
        StructuredOutputError for a constraint cached as invalid."""
        key, _ = grammar_for(params)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if isinstance(hit, str):
            raise StructuredOutputError(f"invalid {params.kind} constraint: {hit}")
        return hit

    def compile_in_background(self, params: StructuredOutputsParams) -> Future:
        """`compile(params)` on a thread of its own; the future holds the template or the
        StructuredOutputError. llguidance builds without the GIL, so the caller's thread
        (the engine's step loop) goes on meanwhile."""
        with self._lock:
            if self._background is None:
                self._background = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar-bg")
            background = self._background
        return background.submit(self.compile, params)

    def _build_once(self, key: str, grammar: str) -> Future:
        """The build of `key`: the one in flight, or a new one. A build caches its result
        when it ends, whether or not anyone still waits for it: a constraint that ran past
        `compile_timeout_s` is built once, not once per retry, and a repeat after it ends
        gets its outcome from the cache."""
        tokenizer = self.tokenizer
        with self._lock:
            future = self._building.get(key)
            if future is not None:
                return future
            if key in self._cache:  # built since the caller looked
                future = Future()
                future.set_result(self._cache[key])
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="tokenmill-grammar")
            future = self._pool.submit(self._build_and_cache, key, tokenizer, grammar)
            self._building[key] = future
            return future

    def _build_and_cache(
        self, key: str, tokenizer: llguidance.LLTokenizer, grammar: str
    ) -> llguidance.LLMatcher | str:
        try:
            hit = self._build(tokenizer, grammar)
        except BaseException:
            with self._lock:
                self._building.pop(key, None)
            raise
        with self._lock:  # one step: a caller sees the build in flight or its outcome
            self._building.pop(key, None)
            self._cache[key] = hit
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return hit

    def _build(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher | str:
        """A matcher, or the error message. Computes the first mask once, so that errors
        the lexer finds only on its first step surface here, not mid-generation."""
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self.limits)
        if not matcher.is_error():
            scratch = torch.empty(self.num_words, dtype=torch.int32)
            matcher.unsafe_compute_mask_ptr(scratch.data_ptr(), self.num_words * 4)
        if matcher.is_error():
            return matcher.get_error()
        return matcher

    # ---- requests (engine thread) --------------------------------------------------------
    def add_request(self, request_id: str, template: llguidance.LLMatcher) -> None:
        """Give sequence `request_id` its own matcher, a copy of `template`."""
        self._matchers[request_id] = template.deep_copy()

    def remove_request(self, request_id: str) -> None:
        """Free the sequence's matcher (finished or aborted). Unknown ids are ignored."""
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    @property
    def num_requests(self) -> int:
        return len(self._matchers)

    def step_masks(
        self, sample_request_ids: list[str], drafts: dict[str, list[int]] | None = None
    ) -> StructuredStep | None:
        """Masks for this step's sampling positions; None when none of them has a
        constraint. Each sampling row (`sample_request_ids`, in row order) is one
        position, or 1 + k with k `drafts` (speculative decoding): position i is masked
        as after its first i drafts (`valid_drafts` checked them). A matcher in an error
        state (a step exceeded its fuel) allows only EOS, and `accept` then reports it."""
        drafts = drafts or {}
        rows: list[tuple[int, llguidance.LLMatcher, list[int]]] = []
        position = 0
        for rid in sample_request_ids:
            ahead = drafts.get(rid, [])
            if rid in self._matchers:
                rows.append((position, self._matchers[rid], ahead))
            position += 1 + len(ahead)
        if not rows:
            return None
        num = sum(1 + len(ahead) for _, _, ahead in rows)
        if self._bitmask.shape[0] < num:
            self._bitmask = torch.empty(max(num, 2 * self._bitmask.shape[0]), self.num_words,
                                        dtype=torch.int32)
        bitmask = self._bitmask[:num]
        row_bytes = self.num_words * 4
        if num == 1:
            rows[0][1].unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
        elif not drafts:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=min(4, os.cpu_count() or 1))
            self._executor.unsafe_compute_mask_ptr(
                [(m, k) for k, (_, m, _) in enumerate(rows)], bitmask.data_ptr(), row_bytes, num
            )
        else:  # drafts: each position's mask after consuming the drafts before it
            k = 0
            for _, matcher, ahead in rows:
                for i in range(len(ahead) + 1):
                    matcher.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), row_bytes)
                    k += 1
                    if i < len(ahead) and not matcher.consume_token(ahead[i]):
                        raise RuntimeError(f"draft token {ahead[i]} was not validated")
                if ahead:
                    matcher.rollback(len(ahead))
        ended: list[int] = []
        positions: list[int] = []
        k = 0
        for start, matcher, ahead in rows:
            positions.extend(range(start, start + 1 + len(ahead)))
            if matcher.is_error():
                self._allow_only_eos(bitmask[k])
                ended.append(start)
            elif matcher.is_stopped():
                ended.append(start)
            k += 1 + len(ahead)
        return StructuredStep(bitmask, positions, ended)

    def valid_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the request's constraint accepts, short of
        completing it (past a complete constraint only EOS may follow). A request
        without a constraint keeps them all."""
        matcher = self._matchers.get(request_id)
        if matcher is None or not drafts:
            return drafts
        if matcher.is_stopped() or matcher.is_error():
            return []
        n = matcher.validate_tokens(drafts)
        kept = 0
        for token in drafts[:n]:
            if not matcher.consume_token(token) or matcher.is_stopped():
                break
            kept += 1
        consumed = kept + (1 if kept < n else 0)
        matcher.rollback(consumed)
        return drafts[:kept]

    def _allow_only_eos(self, row: torch.Tensor) -> None:
        row.zero_()
        for t in self.eos_token_ids:
            word = row[t // 32].item() | (1 << (t % 32))
            row[t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def accept(self, request_id: str, token_id: int) -> str | None:
        """Advance the sequence's matcher by its sampled token; None on success, else the
        error (the token broke the constraint, or the matcher had failed before)."""
        matcher = self._matchers[request_id]
        if matcher.consume_token(token_id):
            return None
        return matcher.get_error() or f"token {token_id} does not continue the constraint"

    def is_ended(self, request_id: str) -> bool:
        """Whether the sequence's constraint is complete (only EOS may follow)."""
        return self._matchers[request_id].is_stopped()
