"""Prefix reuse per turn of a replay: prompt tokens an engine computed vs tokens it had not seen.

For completion-style replays (every prompt is raw text of one-token words, no chat template),
per request of a session:

- seen: the longest prefix, in words, that the prompt shares with an earlier prompt of the
  same session whose first token had arrived before this one was sent (by then the engine
  had computed that prompt's KV). The replay resends no generated text, so the previous
  reply is never part of a shared prefix.
- new = prompt words - seen.
- computed = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens, as reported.

An engine that keeps the session's KV and hits it in whole blocks computes at most
new + one block (the partial block at the end of the shared prefix, or the last block when
the whole prompt was seen). No I/O here; `requests` are run.py's per-request dicts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass


def common_prefix_len(a: list[str], b: list[str]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def seen_prefix_words(requests: list[dict], prompts: dict[tuple[str, int], str]) -> list[int]:
    """For each request (same order), the words its prompt shares with the longest matching
    earlier prompt of its session that had streamed its first token before this was sent.

    `prompts` maps (session, turn) to the prompt text; requests need session, turn, start, ttft.
    """
    words = {key: text.split() for key, text in prompts.items()}
    by_session: dict[str, list[dict]] = defaultdict(list)
    for r in requests:
        by_session[r["session"]].append(r)
    out = []
    for r in requests:
        mine = words[(r["session"], r["turn"])]
        best = 0
        for e in by_session[r["session"]]:
            if e is r or math.isnan(e["ttft"]) or e["start"] + e["ttft"] > r["start"]:
                continue
            best = max(best, common_prefix_len(mine, words[(e["session"], e["turn"])]))
        out.append(best)
    return out


@dataclass(frozen=True, slots=True)
class TurnReuse:
    session: str
    turn: int
    new_tokens: int  # prompt words not in an earlier, already prefilled prompt
    computed_tokens: int  # reported prompt tokens - reported cached tokens
    prompt_offset: int  # reported prompt tokens - words sent (0 unless the engine adds tokens)

    @property
    def excess(self) -> int:
        return self.computed_tokens - self.new_tokens


def turn_reuse(requests: list[dict]) -> list[TurnReuse] | None:
    """Every finished request except each session's first sent one; None when the engine
    reports no cached tokens. Requests need expected_prompt_tokens (words sent),
    seen_prefix_words, prompt_tokens and cached_tokens."""
    ok = [r for r in requests if r["ok"]]
    if not ok or any(r["cached_tokens"] is None for r in ok):
        return None
    first: dict[str, tuple[float, int]] = {}
    for r in requests:
        first[r["session"]] = min(first.get(r["session"], (math.inf, 0)), (r["start"], r["turn"]))
    return [
        TurnReuse(
            r["session"],
            r["turn"],
            r["expected_prompt_tokens"] - r["seen_prefix_words"],
            r["prompt_tokens"] - r["cached_tokens"],
            r["prompt_tokens"] - r["expected_prompt_tokens"],
        )
        for r in ok
        if (r["start"], r["turn"]) != first[r["session"]]
    ]


def reuse_summary(turns: list[TurnReuse], block_size: int) -> dict:
    """How many turns computed at most new + block_size prompt tokens, the worst excess
    (computed - new) and the totals."""
    worst = max(turns, key=lambda t: t.excess, default=None)
    return {
        "turns": len(turns),
        "within_bound": sum(t.excess <= block_size for t in turns),
        "block_size": block_size,
        "worst_excess": worst.excess if worst else None,
        "worst_turn": f"{worst.session}#{worst.turn}" if worst else None,
        "new_tokens": sum(t.new_tokens for t in turns),
        "computed_tokens": sum(t.computed_tokens for t in turns),
        "prompt_offsets": sorted({t.prompt_offset for t in turns}),
    }


def working_set_tokens(prompts: list[str], block: int = 16) -> int:
    """Tokens of KV the prompts need held to be computed once: their distinct full
    `block`-word blocks, each named by its whole prefix (as a prefix cache names them),
    times `block`."""
    seen: set[int] = set()
    for text in prompts:
        words = text.split()
        key = 0
        for i in range(len(words) // block):
            key = hash((key, tuple(words[i * block : (i + 1) * block])))
            seen.add(key)
    return len(seen) * block
