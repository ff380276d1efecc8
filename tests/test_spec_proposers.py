"""The draft proposers against brute-force references: suffix decoding's tree queries
(every string's occurrences counted by scanning) and n-gram prompt lookup (a scan)."""

from __future__ import annotations

import random

import pytest

from tokenmill.spec_decode.ngram import NgramIndex
from tokenmill.spec_decode.suffix import Draft, SuffixDecodingCache, SuffixIndex


def _occurrences(seqs: list[list[int]], s: list[int]) -> list[tuple[int, int]]:
    """(sequence rank, end position) of every occurrence of s, by scanning."""
    m = len(s)
    return [(r, i + m - 1) for r, seq in enumerate(seqs)
            for i in range(len(seq) - m + 1) if seq[i : i + m] == s]


def brute_speculate(seqs, context, depth, k, factor, offset, min_prob) -> Draft:
    """The module docstring's definition, from counts found by scanning every sequence."""
    best = Draft()
    context = context[-depth:]
    for m in range(1, len(context)):
        s = context[-m:]
        if not _occurrences(seqs, s):
            break
        max_tokens = min(k, int(m * factor + offset + 1e-6))
        draft, prob, path = Draft(), 1.0, list(s)
        while len(draft.token_ids) < max_tokens and len(path) < depth:
            occ = _occurrences(seqs, path)
            follow = {}
            for r, p in occ:
                if p + 1 < len(seqs[r]):
                    t = seqs[r][p + 1]
                    n, latest = follow.get(t, (0, (-1, -1)))
                    follow[t] = (n + 1, max(latest, (r, p)))
            if not follow:
                break
            token = max(follow, key=lambda t: follow[t])
            prob *= follow[token][0] / len(occ)
            if prob < min_prob:
                break
            draft.token_ids.append(token)
            draft.probs.append(prob)
            draft.score += prob
            path.append(token)
        if draft.score >= best.score:
            best, best.match_len = draft, m
    return best


@pytest.mark.parametrize("seed", range(6))
def test_suffix_index_matches_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])
    depth = rng.choice([4, 8, 24])
    seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(3)]
    # repeated stretches, as edits and tool calls quote their context
    seqs[0] += seqs[0][5:25]
    index = SuffixIndex(depth)
    for r, seq in enumerate(seqs):
        cut = rng.randrange(len(seq) + 1)
        index.extend(r, seq[:cut])
        index.extend(r, seq[cut:])  # appends in pieces, as outputs arrive
    for _ in range(40):
        context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        context = rng.choice(seqs)[: rng.randrange(1, 40)] + context
        args = (rng.choice([1, 4, 16]), rng.choice([0.5, 1.0, 3.0]), rng.choice([0.0, 2.0]),
                rng.choice([0.0, 0.1, 0.5]))
        got = index.speculate(context, *args)
        want = brute_speculate(seqs, context, depth, *args)
        assert got.token_ids == want.token_ids, (context, args)
        assert got.probs == pytest.approx(want.probs)
        assert got.match_len == want.match_len


def test_suffix_index_remove_forgets_the_sequence():
    index = SuffixIndex(8)
    index.extend("a", [1, 2, 3, 4, 5])
    index.extend("b", [9, 9, 9])
    assert index.speculate([7, 1, 2], 4).token_ids == [3, 4]
    index.remove("a")
    assert index.speculate([7, 1, 2], 4).token_ids == []
    assert index.speculate([9, 9], 4, min_token_prob=0.0).token_ids == [9]
    with pytest.raises(ValueError, match="max_depth"):
        SuffixIndex(0)


def test_suffix_cache_local_global_and_eviction():
    cache = SuffixDecodingCache(max_tree_depth=16, max_cached_requests=2)
    cache.start_request("r0", [1, 2, 3])
    cache.add_response("r0", [10, 11, 12, 13, 14, 15])
    cache.stop_request("r0")
    # a new request whose context ends like r0's output: the global tree drafts it
    cache.start_request("r1", [7, 10, 11, 12])
    assert cache.speculate("r1", 8).token_ids == [13, 14, 15]
    # its own prompt wins where it scores higher
    cache.add_response("r1", [7, 10])
    assert cache.speculate("r1", 8, min_token_prob=0.0).token_ids[:2] == [11, 12]
    cache.start_request("r2", [5])
    cache.start_request("r3", [5])  # two cached at most: r0's output leaves first
    assert cache.cached_requests == 2
    cache.stop_request("r1")
    cache.start_request("r4", [7, 10, 11, 12])
    assert cache.speculate("r4", 8).token_ids != [13, 14, 15]
    with pytest.raises(ValueError, match="already active"):
        cache.start_request("r4", [1])


def brute_ngram(seq, k, min_n, max_n):
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k]
    return []


@pytest.mark.parametrize("seed", range(4))
def test_ngram_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(200):
        vocab = rng.choice([2, 4, 30])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(1, 6)
        index = NgramIndex(seq[: len(seq) // 2])
        index.extend(seq[len(seq) // 2 :])
        assert index.propose(k, min_n, max_n) == brute_ngram(seq, k, min_n, max_n), (seq, k, min_n, max_n)
