"""N-gram drafts (prompt lookup decoding): find the sequence's last n tokens earlier in
the sequence, for the largest n in [min_n, max_n] that occurs, and propose the k tokens
that followed its most recent earlier occurrence (vLLM's `ngram` method).

`NgramIndex` keeps, per token, the positions where it occurs, so a lookup filters the
last token's occurrences one token back per n instead of scanning the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One request's tokens (prompt + output) and where each token occurs."""

    def __init__(self, token_ids: Sequence[int] = ()) -> None:
        self.token_ids: list[int] = []
        self._where: dict[int, list[int]] = {}
        self.extend(token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            self._where.setdefault(token, []).append(len(self.token_ids))
            self.token_ids.append(token)

    def propose(self, k: int, min_n: int, max_n: int) -> list[int]:
        """Up to `k` tokens following the most recent earlier occurrence of the longest
        suffix of length n in [min_n, max_n] that occurs earlier; [] if none does."""
        seq = self.token_ids
        end = len(seq) - 1  # the suffix ends here; an earlier occurrence ends before it
        if end < min_n or k < 1:
            return []
        # positions p < end where seq[p] == seq[end]: candidate occurrence ends
        candidates = [p for p in self._where.get(seq[end], ()) if p < end]
        best: int | None = None
        for n in range(1, min(max_n, end) + 1):
            if n > 1:
                want = seq[end - n + 1]
                candidates = [p for p in candidates if p >= n - 1 and seq[p - n + 1] == want]
            if not candidates:
                break
            if n >= min_n:
                best = candidates[-1]  # the most recent occurrence of the longest match
        if best is None:
            return []
        return seq[best + 1 : best + 1 + k]
