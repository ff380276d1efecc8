"""Suffix decoding (Oliaro et al., arctic-inference): drafts from a suffix tree over the
request's own prompt and output plus a global tree over recent outputs, no draft model.

Semantics (those of arctic-inference's depth-limited suffix tree): a tree of depth D over
a set of sequences counts, for every string s of at most D tokens, its occurrences
count(s) in the sequences. To draft after a context, for each match length m (1 <= m <
min(len(context), D + 1)) whose suffix s = context[-m:] occurs, walk down from s: the
next token is the child t of highest count(s + t) (ties: the one that occurred most
recently), its estimated probability the running product of count(s + t) / count(s);
the walk stops at D tokens deep, at `max_tokens = min(k, m * factor + offset)` tokens, or
before a token whose probability falls below `min_token_prob`. The draft's score is the
sum of its probabilities (the expected accepted length); the best score over m wins
(ties: the longer match), and the request's own tree wins ties against the global one.

Why not a trie of nodes: in Python a node per (position, depth) costs D objects per
token (tens of MB for one long prompt). `SuffixIndex` answers the same queries from
occurrence lists: where each token occurs; the occurrences of s = context[-m:] are those
of its last token filtered one token back per m, and a node's children are the tokens
that follow its occurrences. An append costs O(1); a draft costs the sizes of the
occurrence lists it filters. `tests/test_spec_suffix.py` checks it against a brute-force
scan of every string's occurrences.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # estimated, cumulative
    score: float = 0.0  # sum of probs: the expected number of accepted tokens
    match_len: int = 0


class SuffixIndex:
    """The occurrence counts of a depth-`max_depth` suffix tree over several sequences,
    each under a key; sequences grow at their end and leave whole."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth={max_depth} must be >= 1")
        self.max_depth = max_depth
        self._seqs: dict[Hashable, list[int]] = {}
        self._rank: dict[Hashable, int] = {}  # insertion order: later sequences are newer
        self._next_rank = 0
        # token -> key -> positions (ascending) where the token occurs in that sequence
        self._where: dict[int, dict[Hashable, list[int]]] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def sequence(self, key: Hashable) -> list[int]:
        return self._seqs[key]

    def extend(self, key: Hashable, token_ids: Sequence[int]) -> None:
        """Append tokens to the sequence under `key` (a new key starts a new sequence)."""
        seq = self._seqs.get(key)
        if seq is None:
            seq = self._seqs[key] = []
            self._rank[key] = self._next_rank
            self._next_rank += 1
        where = self._where
        for token in token_ids:
            where.setdefault(token, {}).setdefault(key, []).append(len(seq))
            seq.append(token)

    def remove(self, key: Hashable) -> None:
        seq = self._seqs.pop(key)
        del self._rank[key]
        for token in set(seq):
            per_key = self._where[token]
            del per_key[key]
            if not per_key:
                del self._where[token]

    def speculate(
        self,
        context: Sequence[int],
        max_spec_tokens: int,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
    ) -> Draft:
        """The best draft after `context` (see the module's docstring)."""
        best = Draft()
        context = list(context[-self.max_depth :])
        if len(context) < 2 or max_spec_tokens < 1:
            return best
        # occurrences of s = context[-m:] as (key, position of s's last token)
        occ = [(k, p) for k, ps in self._where.get(context[-1], {}).items() for p in ps]
        for m in range(1, len(context)):
            if m > 1:
                want = context[-m]
                occ = [(k, p) for k, p in occ if p >= m - 1 and self._seqs[k][p - m + 1] == want]
            if not occ:
                break
            max_tokens = min(max_spec_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6))
            draft = self._walk(occ, m, max_tokens, min_token_prob)
            if draft.score >= best.score:
                best = draft
                best.match_len = m
        return best

    def _walk(
        self, occ: list[tuple[Hashable, int]], depth: int, max_tokens: int, min_prob: float
    ) -> Draft:
        draft = Draft()
        prob = 1.0
        seqs, rank = self._seqs, self._rank
        while len(draft.token_ids) < max_tokens and depth < self.max_depth:
            counts: dict[int, int] = {}
            latest: dict[int, tuple[int, int]] = {}
            for k, p in occ:
                seq = seqs[k]
                if p + 1 < len(seq):
                    t = seq[p + 1]
                    counts[t] = counts.get(t, 0) + 1
                    recency = (rank[k], p)
                    if recency > latest.get(t, (-1, -1)):
                        latest[t] = recency
            if not counts:
                break
            token = max(counts, key=lambda t: (counts[t], latest[t]))
            prob *= counts[token] / len(occ)
            if prob < min_prob:
                break
            draft.token_ids.append(token)
            draft.probs.append(prob)
            draft.score += prob
            occ = [(k, p + 1) for k, p in occ if p + 1 < len(seqs[k]) and seqs[k][p + 1] == token]
            depth += 1
        return draft


class SuffixDecodingCache:
    """Per active request a tree over its prompt and output; one global tree over the
    outputs of the last `max_cached_requests` requests (active ones included, FIFO)."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 1000) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self._local: dict[Hashable, SuffixIndex] = {}
        self._global = SuffixIndex(max_tree_depth)

    @property
    def active_requests(self) -> list[Hashable]:
        return list(self._local)

    @property
    def cached_requests(self) -> int:
        return len(self._global)

    def start_request(self, request_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        if request_id in self._local:
            raise ValueError(f"request {request_id!r} is already active in the suffix cache")
        local = self._local[request_id] = SuffixIndex(self.max_tree_depth)
        local.extend(0, prompt_token_ids)
        if self.max_cached_requests:
            if request_id in self._global:
                self._global.remove(request_id)
            self._global.extend(request_id, ())
            while len(self._global) > self.max_cached_requests:
                oldest = next(k for k in self._global._seqs if k != request_id)
                self._global.remove(oldest)

    def add_response(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        """Tokens the request generated (accepted), appended to its tree and the global one."""
        self._local[request_id].extend(0, token_ids)
        if request_id in self._global:
            self._global.extend(request_id, token_ids)

    def stop_request(self, request_id: Hashable) -> None:
        """The request ended: its tree goes; its output stays in the global tree."""
        self._local.pop(request_id, None)

    def speculate(
        self,
        request_id: Hashable,
        max_spec_tokens: int,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
    ) -> Draft:
        """A draft to follow the request's tokens so far (its context is its own tree's
        sequence: prompt + output)."""
        local = self._local[request_id]
        context = local.sequence(0)[-self.max_tree_depth :]
        args = (max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob)
        own = local.speculate(context, *args)
        if not self.max_cached_requests:
            return own
        other = self._global.speculate(context, *args)
        return own if own.score >= other.score else other
