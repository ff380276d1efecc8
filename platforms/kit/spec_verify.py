"""Exact verification of draft tokens against the target model's logits.

A request with drafts d_1..d_k computed 1 + k positions this step; the logits at
position i give the target distribution p_i of the token after d_i (d_0: its last
sampled token), processed exactly as `Sampler` processes one row (penalties over the
outputs including d_1..d_i, logit_bias, min_tokens, and the grammar mask the runner
applied; then temperature, min_p, top_k, top_p).

- Greedy: d_{i+1} is accepted while it is argmax p_i; the first position that disagrees
  emits the target's argmax instead, and if every draft is accepted position k adds one
  more token (the bonus). The tokens are those of decoding one at a time.
- Random: every draft here is a single token proposed with certainty (n-gram and suffix
  drafts), for which rejection sampling accepts draft d with probability p(d). Drawing
  t ~ p with the very uniform decoding one token at a time would use, and accepting d
  iff t == d, accepts with exactly p(d) and emits exactly t ~ p at every position: the
  same coupling as greedy. So a request draws one number per emitted token from its
  generator (what `replay_draws` replays after a preemption), and a seeded request's
  output is the one it has without speculation, whatever the drafts were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.platforms.kit.sampler import (
    SamplingRow,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    gather_logprobs,
    replay_draws,
    sample_with_uniforms,
)
from tokenmill.platforms.step import Logprobs, SamplingSpec


@dataclass(slots=True)
class VerifyRow:
    """One request's positions this step: logits rows [offset, offset + 1 + len(drafts))."""

    params: SamplingSpec
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before this step
    generator: torch.Generator | None
    draft_token_ids: list[int]
    offset: int


@dataclass(slots=True)
class Verified:
    token_ids: list[int]  # accepted drafts, then the target's own token
    logprobs: list[Logprobs] | None  # one per token (params.logprobs set), else None

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def verify(logits: torch.Tensor, rows: list[VerifyRow]) -> list[Verified]:
    """The tokens each row emits (see the module's docstring). `logits`: float [positions,
    vocab], every row's 1 + k positions at its offset. Does not modify `logits`."""
    expanded: list[SamplingRow] = []
    index: list[int] = []
    for row in rows:
        for i in range(len(row.draft_token_ids) + 1):
            expanded.append(SamplingRow(
                params=row.params, prompt_token_ids=row.prompt_token_ids,
                output_token_ids=row.output_token_ids + row.draft_token_ids[:i],
                generator=row.generator,
            ))
            index.append(row.offset + i)
    idx = torch.tensor(index, dtype=torch.int64, device=logits.device)
    raw = logits[idx].float()
    processed = apply_penalties(raw, expanded)
    if processed is not raw:
        big = torch.finfo(processed.dtype).max
        processed.clamp_(min=-big, max=big)
    processed = apply_logit_bias(processed, expanded, owned=processed is not raw)
    processed = apply_min_tokens(processed, expanded, owned=processed is not raw)

    starts, pos = [], 0
    for row in rows:
        starts.append(pos)
        pos += len(row.draft_token_ids) + 1
    emitted: list[list[int]] = [[] for _ in rows]
    greedy = [r for r, row in enumerate(rows) if row.params.greedy]
    if greedy:
        gidx = [starts[r] + i for r in greedy for i in range(len(rows[r].draft_token_ids) + 1)]
        argmax = processed[torch.tensor(gidx, device=processed.device)].argmax(-1).tolist()
        cursor = 0
        for r in greedy:
            drafts = rows[r].draft_token_ids
            picks = argmax[cursor : cursor + len(drafts) + 1]
            cursor += len(drafts) + 1
            n = 0
            while n < len(drafts) and picks[n] == drafts[n]:
                n += 1
            emitted[r] = drafts[:n] + [picks[n]]
    random = [r for r, row in enumerate(rows) if not row.params.greedy]
    if random:
        _verify_random(processed, expanded, rows, starts, random, emitted)

    out = []
    for r, row in enumerate(rows):
        lps = None
        if row.params.logprobs is not None:
            n = len(emitted[r])
            pos_idx = torch.arange(starts[r], starts[r] + n, device=raw.device)
            ids = torch.tensor(emitted[r], dtype=torch.int64, device=raw.device)
            lps = gather_logprobs(raw[pos_idx], ids, [row.params.logprobs] * n)
        out.append(Verified(emitted[r], lps))
    return out


def _verify_random(
    processed: torch.Tensor, expanded: list[SamplingRow], rows: list[VerifyRow],
    starts: list[int], random: list[int], emitted: list[list[int]],
) -> None:
    """Sample every position of the random rows with the uniforms a one-token-at-a-time
    decode would draw, keep the drafts up to the first that differs from its sample;
    each seeded generator ends exactly one draw per emitted token further on."""
    positions = [starts[r] + i for r in random for i in range(len(rows[r].draft_token_ids) + 1)]
    uniforms, saved = [], {}
    for r in random:
        gen = rows[r].generator
        if gen is not None:
            saved[r] = gen.get_state()
        uniforms += [_uniform(gen, processed.device)
                     for _ in range(len(rows[r].draft_token_ids) + 1)]
    idx = torch.tensor(positions, device=processed.device)
    tokens = sample_with_uniforms(
        processed[idx], [expanded[p] for p in positions],
        torch.tensor(uniforms, dtype=torch.float64, device=processed.device),
    ).tolist()
    cursor = 0
    for r in random:
        drafts = rows[r].draft_token_ids
        picks = tokens[cursor : cursor + len(drafts) + 1]
        cursor += len(drafts) + 1
        n = 0
        while n < len(drafts) and picks[n] == drafts[n]:
            n += 1
        emitted[r] = picks[: n + 1]
        gen = rows[r].generator
        if gen is not None:  # rewind to one draw per emitted token
            gen.set_state(saved[r])
            replay_draws(gen, n + 1)


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    """One float64 uniform in [0, 1), as `Sampler` draws per row per step."""
    if generator is None:
        return torch.rand((), dtype=torch.float64, device=device).item()
    return torch.rand((), dtype=torch.float64, device=generator.device, generator=generator).item()
