"""Verification of drafts: greedy equals one-at-a-time argmax; random sampling keeps the
target distribution (a tiny vocabulary, many draws); one draw per emitted token."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.platforms.kit.sampler import Sampler, SamplingRow, make_generator, replay_draws
from tokenmill.platforms.kit.spec_verify import VerifyRow, verify
from tokenmill.platforms.step import SamplingSpec


def _rows(spec, drafts_per_row, outputs=(), seed=None):
    rows, offset = [], 0
    for drafts in drafts_per_row:
        rows.append(VerifyRow(spec, [1, 2], list(outputs), make_generator(seed, "cpu"),
                              list(drafts), offset))
        offset += len(drafts) + 1
    return rows


def test_greedy_accepts_the_argmax_prefix_then_the_target_token():
    torch.manual_seed(0)
    logits = torch.randn(4, 11)
    target = logits.argmax(-1).tolist()
    spec = SamplingSpec(temperature=0.0)
    cases = {
        (target[0], target[1], target[2]): target,  # all accepted + bonus
        (target[0], (target[1] + 1) % 11, 0): target[:2],  # second rejected: corrected
        ((target[0] + 1) % 11, 0, 0): target[:1],
    }
    for drafts, want in cases.items():
        (out,) = verify(logits, _rows(spec, [drafts]))
        assert out.token_ids == want
        assert out.num_accepted == len(want) - 1


def test_greedy_penalties_see_the_accepted_drafts():
    # a repetition penalty on position 1 must count draft 1 as an output already
    logits = torch.tensor([[0.0, 5.0, 4.9], [0.0, 5.0, 4.9]])
    spec = SamplingSpec(temperature=0.0, repetition_penalty=2.0)
    (out,) = verify(logits, [VerifyRow(spec, [0], [], None, [1], 0)])
    assert out.token_ids == [1, 2]  # position 1's logit of token 1 halved by the penalty
    sampler_pick = Sampler()(logits[1:], [SamplingRow(spec, [0], [1], None)]).token_ids
    assert sampler_pick == [2]


def _reference(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """softmax(logits / T) over the top_k tokens, written out by hand."""
    z = logits.double() / temperature
    keep = z.topk(top_k).indices
    masked = torch.full_like(z, -math.inf)
    masked[keep] = z[keep]
    return torch.softmax(masked, -1)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_random_sampling_keeps_the_target_distribution(temperature, top_k):
    torch.manual_seed(1)
    vocab, n = 5, 12000
    logits = torch.randn(3, vocab) * 1.5
    spec = SamplingSpec(temperature=temperature, top_k=top_k)
    p = [_reference(logits[i], temperature, top_k or vocab) for i in range(3)]
    drafts = (int(p[0].argmax()), int(p[1].argmin()))  # a likely draft, then an unlikely one
    big = logits.repeat(n, 1)
    out = verify(big, _rows(spec, [drafts] * n))
    first = torch.bincount(torch.tensor([o.token_ids[0] for o in out]), minlength=vocab)
    second = [o.token_ids[1] for o in out if o.token_ids[0] == drafts[0]]
    second = torch.bincount(torch.tensor(second), minlength=vocab)
    third = [o.token_ids[2] for o in out if o.token_ids[:2] == list(drafts)]
    for counts, target in ((first, p[0]), (second, p[1])):
        total = int(counts.sum())
        freq = counts.double() / total
        sigma = (target * (1 - target) / total).sqrt()
        assert ((freq - target).abs() <= 5 * sigma + 1e-9).all(), (freq, target)
    # the second draft is unlikely: rarely accepted, and then followed by a p_2 token
    assert len(third) < n * float(p[0][drafts[0]]) * float(p[1][drafts[1]]) * 1.5 + 50
    # with top_k, tokens outside the top k never appear
    if top_k:
        outside = set(range(vocab)) - set(logits[0].topk(top_k).indices.tolist())
        assert not any(first[t] for t in outside)


def test_seeded_verification_emits_what_the_sampler_draws_one_at_a_time():
    torch.manual_seed(2)
    logits = torch.randn(5, 9)
    spec = SamplingSpec(temperature=0.8, top_p=0.7, min_p=0.05)
    gen = make_generator(5, "cpu")
    one_at_a_time = [Sampler()(logits[i : i + 1], [SamplingRow(spec, [1, 2], [], gen)]).token_ids[0]
                     for i in range(5)]
    for drafts in (one_at_a_time[:4], one_at_a_time[:2] + [(one_at_a_time[2] + 1) % 9, 0]):
        (out,) = verify(logits, _rows(spec, [drafts], seed=5))
        n = len(out.token_ids)
        assert out.token_ids == one_at_a_time[:n]
        assert n == (5 if drafts == one_at_a_time[:4] else 3)


def test_seeded_rows_draw_once_per_emitted_token_and_repeat():
    torch.manual_seed(3)
    logits = torch.randn(4, 7)
    spec = SamplingSpec(temperature=1.0)
    drafts = [tuple(logits[:3].argmax(-1).tolist())]
    a = verify(logits, _rows(spec, drafts, seed=42))
    rows = _rows(spec, drafts, seed=42)
    b = verify(logits, rows)
    assert a[0].token_ids == b[0].token_ids
    fresh = make_generator(42, "cpu")
    replay_draws(fresh, len(b[0].token_ids))
    assert torch.equal(fresh.get_state(), rows[0].generator.get_state())


def test_logprobs_are_the_targets_at_each_emitted_position():
    torch.manual_seed(4)
    logits = torch.randn(3, 9)
    spec = SamplingSpec(temperature=0.0, logprobs=2)
    drafts = tuple(logits[:2].argmax(-1).tolist())
    (out,) = verify(logits, _rows(spec, [drafts]))
    assert len(out.logprobs) == 3
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        want = torch.log_softmax(logits[i].float(), -1)
        assert lp.token_ids[0] == token
        assert lp.logprobs[0] == pytest.approx(float(want[token]))
        assert lp.token_ids[1:] == want.topk(2).indices.tolist()
