"""Workloads for the serving benchmark: synthetic shapes and scaled trace replays.

Prompts are made of words that the model's tokenizer maps to exactly one token each
(" word"), so a prompt of N words is N tokens on every engine, and two prompts that share
their first K words share their first K tokens. A trace's hash id becomes a fixed block of
such words, seeded by (scope, id), which reproduces the trace's prefix sharing exactly.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

from tokenmill.server.bench.loadgen import Session, Turn


def one_token_words(tokenizer_json: Path, limit: int = 4000) -> list[str]:
    """Lower-case words that encode to a single token with a leading space, checked by encoding."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    cands = sorted(w[1:] for w in tok.get_vocab() if re.fullmatch(r"Ġ[a-z]{3,9}", w))
    words = [w for w in cands if len(tok.encode(" " + w, add_special_tokens=False).ids) == 1]
    if len(words) < 256:
        raise ValueError(f"only {len(words)} one-token words found in {tokenizer_json}")
    return words[:limit]


@dataclass(slots=True)
class Words:
    vocab: list[str]

    def block(self, seed: object, n: int) -> str:
        rng = random.Random(repr(seed))
        return "".join(" " + w for w in rng.choices(self.vocab, k=n))

    def text(self, seed: object, n: int) -> str:
        return self.block(seed, n)


def uniform(words: Words, num: int, input_len: int, output_len: int, tag: str = "u") -> list[Session]:
    return [Session(f"{tag}{i}", [Turn(output_len, prompt=words.text((tag, i), input_len),
                                       expected_prompt_tokens=input_len)]) for i in range(num)]


def mixed(words: Words, num: int, seed: int = 0) -> list[Session]:
    """Prompt 32..2048 and output 16..256 tokens, log-uniform (a spread of real request sizes)."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        n_in = int(math.exp(rng.uniform(math.log(32), math.log(2048))))
        n_out = int(math.exp(rng.uniform(math.log(16), math.log(256))))
        out.append(Session(f"m{i}", [Turn(n_out, prompt=words.text(("m", i), n_in),
                                          expected_prompt_tokens=n_in)]))
    return out


def shared_prefix(words: Words, num: int, num_groups: int, prefix_len: int, suffix_len: int,
                  output_len: int) -> list[Session]:
    """`num` requests in `num_groups` groups; a group shares a `prefix_len`-token prefix."""
    return [Session(f"p{i}", [Turn(output_len, prompt=words.text(("pre", i % num_groups), prefix_len)
                                   + words.text(("suf", i), suffix_len),
                                   expected_prompt_tokens=prefix_len + suffix_len)])
            for i in range(num)]


def multi_turn(words: Words, num_sessions: int, num_turns: int, system_len: int, user_len: int,
               output_len: int, pause_s: float) -> list[Session]:
    """Chat sessions: every turn resends the whole history (system, users, real replies)."""
    return [Session(f"c{s}", [Turn(output_len, user=words.text(("u", s, t), user_len),
                                   pause_s=pause_s, expected_prompt_tokens=user_len)
                              for t in range(num_turns)],
                    chat=True, system=words.text(("sys", s), system_len))
            for s in range(num_sessions)]


def _trace_session(words: Words, trace: dict, factor: int, time_factor: float, max_model_len: int,
                   start_s: float, scope: object, name: str, slot: int | None = None) -> Session:
    """One Claude Code session, lengths and block size divided by `factor`, times by
    `time_factor`, every turn's `at_s` counted from `start_s`. Blocks are seeded by
    (scope, hash id): the same scope reproduces the trace's sharing, another scope shares nothing."""
    if trace["block_size"] % factor:
        raise ValueError(f"factor {factor} does not divide block size {trace['block_size']}")
    bs = trace["block_size"] // factor
    blocks: dict[int, str] = {}
    turns = []
    for req in trace["requests"]:
        n_in = max(1, round(req["in"] / factor))
        n_out = max(1, round(req["out"] / factor))
        if n_in + n_out > max_model_len:
            continue
        for h in req["hash_ids"]:
            if h not in blocks:
                blocks[h] = words.block((scope, h), bs)
        prompt = "".join(blocks[h] for h in req["hash_ids"])
        prompt = " ".join(prompt.split(" ")[: n_in + 1])  # leading "" + n_in words
        n_in = min(n_in, len(req["hash_ids"]) * bs)
        stream = "sub" if req.get("type") == "s" else "main"
        turns.append(Turn(n_out, prompt=prompt, pause_s=req.get("think_time", 0.0) / time_factor,
                          at_s=start_s + req["t"] / time_factor, stream=stream,
                          expected_prompt_tokens=n_in))
    return Session(name, turns, start_s=start_s, slot=slot)


def claude_code(words: Words, trace_dir: Path, factor: int, time_factor: float, max_sessions: int,
                max_model_len: int, stagger_s: float) -> list[Session]:
    """Claude Code sessions with every length and the block size divided by `factor`.

    Pauses (`think_time`) and arrival offsets (`t`) are divided by `time_factor`. Main-agent
    and sub-agent requests (`type` 'n' / 's') are two streams: each waits for its previous
    request, then its scaled pause, and never goes before its scaled `t`. Session i starts at
    i * stagger_s. Requests whose scaled prompt + output would pass max_model_len are dropped.
    """
    files = sorted(p for p in trace_dir.glob("*.json"))[:max_sessions]
    sessions = []
    for i, path in enumerate(files):
        trace = json.loads(path.read_text())
        sessions.append(_trace_session(words, trace, factor, time_factor, max_model_len,
                                       i * stagger_s, trace["id"], trace["id"]))
    return sessions


def claude_code_slots(words: Words, trace_dir: Path, factor: int, time_factor: float,
                      num_slots: int, window_s: float, ramp_s: float,
                      max_model_len: int) -> list[Session]:
    """`num_slots` concurrent Claude Code sessions held for `window_s`: as `claude_code`, but
    slot i replays the trace's sessions i, i + n, i + 2n, ... (wrapping around) back to back,
    and slot i starts at i * ramp_s / n. A slot gets sessions until their scaled trace
    durations add up to the window; a replay never runs faster than its trace's times, so a
    slot cannot run out before the window ends. Every replayed session (a trace session on
    its k-th lap, in a run of n slots) has blocks of its own: sessions share nothing.
    """
    traces = [json.loads(p.read_text()) for p in sorted(trace_dir.glob("*.json"))]
    if not traces:
        raise ValueError(f"no *.json traces in {trace_dir}")
    sessions = []
    for slot in range(num_slots):
        start = slot * ramp_s / num_slots
        covered, k = 0.0, 0
        while covered < window_s and k < len(traces):
            index = slot + k * num_slots
            trace = traces[index % len(traces)]
            lap = index // len(traces)
            s = _trace_session(words, trace, factor, time_factor, max_model_len,
                               start if k == 0 else 0.0, (trace["id"], num_slots, lap),
                               f"{trace['id']}/{lap}", slot=slot)
            covered += max((t.at_s for t in s.turns), default=start if k == 0 else 0.0)
            sessions.append(s)
            k += 1
    return sessions


def mooncake(words: Words, path: Path, factor: int, time_factor: float, max_requests: int,
             max_model_len: int) -> list[Session]:
    """Mooncake requests (512-token blocks, global hash ids), lengths and block size divided by
    `factor`, arrivals (`timestamp`, ms) divided by `time_factor`; open loop, one turn each."""
    if 512 % factor:
        raise ValueError(f"factor {factor} does not divide Mooncake's block size 512")
    bs = 512 // factor
    sessions = []
    with path.open() as f:
        for i, line in enumerate(f):
            if len(sessions) >= max_requests:
                break
            req = json.loads(line)
            n_in = max(1, round(req["input_length"] / factor))
            n_out = max(1, round(req["output_length"] / factor))
            if n_in + n_out > max_model_len:
                continue
            prompt = "".join(words.block(("mc", h), bs) for h in req["hash_ids"])
            prompt = " ".join(prompt.split(" ")[: n_in + 1])
            n_in = min(n_in, len(req["hash_ids"]) * bs)
            at = req["timestamp"] / 1000 / time_factor
            sessions.append(Session(f"mc{i}", [Turn(n_out, prompt=prompt, at_s=at,
                                                    expected_prompt_tokens=n_in)], start_s=at))
    return sessions
