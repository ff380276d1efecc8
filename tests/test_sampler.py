"""Sampler against straightforward per-row references (HF processors, explicit sorts)."""

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from tokenmill.platforms.kit.sampler import (
    Sampler,
    SamplingRow,
    apply_logit_bias,
    apply_penalties,
    make_generator,
    prompt_logprobs,
)
from tokenmill.sampling_params import SamplingParams

VOCAB = 50


def row(prompt=(), output=(), seed=None, **kwargs) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(seed=seed, **kwargs).with_defaults(),  # as the engine fills them
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        generator=make_generator(seed, "cpu"),
    )


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return Sampler()(logits, rows).token_ids


def reference_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """One row's sampling distribution, stage by stage in vLLM's order, with a full sort."""
    probs = torch.softmax(logits.double() / temperature, -1)
    keep = probs >= min_p * probs.max()
    order = torch.argsort(torch.where(keep, probs, -1.0), descending=True)
    sorted_probs = torch.where(keep, probs, 0.0)[order]
    if top_k:
        sorted_probs[top_k:] = 0.0
    sorted_probs /= sorted_probs.sum()
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0
    out = torch.zeros_like(probs)
    out[order] = sorted_probs / sorted_probs.sum()
    return out


def frequencies(logits_row: torch.Tensor, num: int, **kwargs) -> torch.Tensor:
    ids = sample(logits_row.repeat(num, 1), [row(**kwargs)] * num)
    return torch.bincount(torch.tensor(ids), minlength=logits_row.numel()).double() / num


def test_greedy_is_argmax_and_leaves_logits_alone():
    logits = torch.randn(6, VOCAB)
    before = logits.clone()
    assert sample(logits, [row(temperature=0.0) for _ in range(6)]) == logits.argmax(-1).tolist()
    mixed = [row(temperature=0.0) if i % 2 else row(temperature=1.0, top_p=0.5) for i in range(6)]
    ids = sample(logits, mixed)
    assert ids[1::2] == logits[1::2].argmax(-1).tolist()
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=1.3),
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.0, top_k=10, top_p=0.7),
        dict(temperature=0.9, min_p=0.1),
    ],
)
def test_sampled_distribution_matches_reference(kwargs):
    torch.manual_seed(0)
    logits = torch.randn(VOCAB) * 2
    num = 10000
    got = frequencies(logits, num, **kwargs)
    want = reference_probs(logits, **kwargs)
    assert got[want == 0].sum() == 0, "sampled a token the filters removed"
    # 4.5 sigma of a binomial frequency, per token
    assert torch.all((got - want).abs() <= 4.5 * (want * (1 - want) / num).sqrt() + 1e-4)


def test_top_p_only_rows_past_the_probe_fall_back_to_a_full_sort():
    # A flat distribution over 600 tokens: the nucleus of top_p=0.9 is ~540 tokens, more
    # than the top-k probe sees.
    logits = torch.randn(600) * 0.1
    num = 1000
    got = frequencies(logits, num, top_p=0.9)
    want = reference_probs(logits, top_p=0.9)
    assert got[want == 0].sum() == 0
    assert (got > 0).sum() > 300


def test_top_k_1_and_tiny_top_p_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(16, VOCAB)
    greedy = logits.argmax(-1).tolist()
    assert sample(logits, [row(temperature=1.5, top_k=1) for _ in range(16)]) == greedy
    assert sample(logits, [row(temperature=1.5, top_p=1e-6) for _ in range(16)]) == greedy
    assert sample(logits, [row(temperature=1.5, min_p=1.0) for _ in range(16)]) == greedy


SEEDED_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=7),
    dict(temperature=1.1, top_p=0.9),
    dict(temperature=1.0, top_k=20, top_p=0.8, min_p=0.02),
    dict(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4),
]


def run_seeded(target: dict, others: list[dict] | None, steps: int = 12) -> list[int]:
    """Tokens of a seeded target row over `steps`, alone or at index 3 among `others`."""
    torch.manual_seed(123)
    step_logits = [torch.randn(8, VOCAB) * 2 for _ in range(steps)]
    target_row = row(prompt=[1, 2, 3], seed=1234, **target)
    rows = [target_row]
    if others is not None:
        rows = [row(seed=s, **kw) if s % 2 else row(**kw) for s, kw in enumerate(others)]
        rows.insert(3, target_row)
    position = rows.index(target_row)
    out = []
    for logits in step_logits:
        for r in rows:  # the other rows' inputs change too
            r.output_token_ids.append(len(r.output_token_ids) % VOCAB)
        batch = logits if others is not None else logits[3:4]
        out.append(sample(batch, rows)[position])
    return out


@pytest.mark.parametrize("target", SEEDED_CASES)
def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(target):
    alone = run_seeded(target, None)
    assert alone == run_seeded(target, None)
    others = [
        dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.5, top_p=0.3),
        dict(temperature=1.0, top_k=40), dict(temperature=2.0, min_p=0.2),
        dict(temperature=1.0, top_k=3, top_p=0.9, presence_penalty=1.0), dict(temperature=0.0),
    ]
    assert run_seeded(target, others) == alone
    assert run_seeded(target, others[::-1]) == alone
    assert len(set(alone)) > 3, "the seeded row did not actually sample"


def test_different_seeds_differ():
    logits = torch.zeros(2, 1000)
    a, b = sample(logits, [row(seed=1), row(seed=2)])
    assert a != b  # 1 in 1000 chance of a false failure; seeds are fixed, so it is stable


def test_penalties_match_per_row_reference():
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB) * 3
    rows = [
        row(prompt=[1, 2, 2, 3], output=[3, 4, 4, 4], repetition_penalty=1.5),
        row(prompt=[5, 6], output=[6, 7, 7], presence_penalty=0.5, frequency_penalty=0.3),
        row(prompt=[8], output=[9, 9], repetition_penalty=0.7, presence_penalty=-1.0,
            frequency_penalty=1.2),
        row(prompt=[1], output=[1]),  # no penalty
    ]
    want = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        ids = torch.tensor([r.prompt_token_ids + r.output_token_ids])
        want[i : i + 1] = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            ids, want[i : i + 1].clone()
        )
        for token in set(r.output_token_ids):
            count = r.output_token_ids.count(token)
            want[i, token] -= p.frequency_penalty * count + p.presence_penalty
    got = apply_penalties(logits, rows)
    assert torch.allclose(got, want)
    assert not torch.equal(got, logits)


def test_penalty_changes_the_greedy_choice():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 2.0
    logits[0, 6] = 1.9
    assert sample(logits, [row(output=[5], temperature=0.0)]) == [5]
    assert sample(logits, [row(output=[5], temperature=0.0, repetition_penalty=1.2)]) == [6]
    assert sample(logits, [row(output=[5], temperature=0.0, presence_penalty=0.2)]) == [6]


def test_out_of_vocab_token_is_an_error_naming_it():
    with pytest.raises(ValueError, match="token id 99 "):
        apply_penalties(torch.zeros(1, VOCAB), [row(prompt=[99], repetition_penalty=1.1)])


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 5.0  # eos
    logits[0, 4] = 4.0  # stop token
    logits[0, 9] = 3.0

    def greedy_after(num_outputs: int, **kwargs) -> int:
        r = row(output=[0] * num_outputs, temperature=0.0, min_tokens=2, stop_token_ids=[4],
                eos_token_ids=frozenset({3}), **kwargs)
        return sample(logits, [r])[0]

    assert greedy_after(0) == 9
    assert greedy_after(1) == 9
    assert greedy_after(2) == 3
    assert greedy_after(0, ignore_eos=True) == 3  # eos cannot end it anyway


def test_logprobs_are_raw_log_softmax_with_ranks():
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB)
    rows = [
        row(temperature=0.5, top_k=5, repetition_penalty=2.0, prompt=[0, 1], logprobs=3),
        row(temperature=0.0, logprobs=0),
        row(temperature=1.0),
    ]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i, k in ((0, 3), (1, 0)):
        lp = out.logprobs[i]
        token = out.token_ids[i]
        assert lp.token_ids[0] == token
        order = ref[i].argsort(descending=True).tolist()
        assert lp.ranks[0] == order.index(token) + 1
        assert lp.token_ids[1:] == order[:k]
        assert lp.ranks[1:] == list(range(1, k + 1))
        assert torch.allclose(torch.tensor(lp.logprobs), ref[i, lp.token_ids])


def test_prompt_logprobs():
    torch.manual_seed(4)
    logits = torch.randn(5, VOCAB)
    next_ids = [3, 1, 4, 1, 5]
    ref = torch.log_softmax(logits, -1)
    got = prompt_logprobs(logits, next_ids, k=2)
    assert len(got) == 5
    for i, lp in enumerate(got):
        order = ref[i].argsort(descending=True).tolist()
        assert lp.token_ids == [next_ids[i], *order[:2]]
        assert lp.ranks == [order.index(next_ids[i]) + 1, 1, 2]
        assert torch.allclose(torch.tensor(lp.logprobs), ref[i, lp.token_ids])
    with pytest.raises(ValueError, match="4 ids"):
        prompt_logprobs(logits, next_ids[:4], k=1)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"\[len\(rows\)=2"):
        Sampler()(torch.zeros(3, VOCAB), [row(), row()])


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a = torch.rand(3, generator=make_generator(7, "cpu"))
    assert torch.equal(a, torch.rand(3, generator=make_generator(7, "cpu")))


def test_extreme_penalties_do_not_break_sampling():
    """A repetition penalty near 0 or huge overflows logits; sampling must still work."""
    from tokenmill.platforms.kit.sampler import Sampler, SamplingRow

    logits = torch.randn(3, 300)
    rows = [
        SamplingRow(
            SamplingParams(temperature=t, repetition_penalty=rp, seed=1).with_defaults(),
            [1, 2], [3], None,
        )
        for t, rp in ((1.0, 5e-324), (0.7, 1e300), (0.0, 1e-300))
    ]
    out = Sampler()(logits, rows)
    assert all(0 <= t < 300 for t in out.token_ids)


def test_logit_bias_matches_a_per_row_reference_and_leaves_other_rows_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    biases = [{7: 100.0, 8: -3.5}, None, {0: -100.0, 49: 2.25}]
    rows = [row(temperature=0.5, logit_bias=b) for b in biases]
    biased = apply_logit_bias(logits, rows, owned=False)
    expected = logits.clone()
    for i, b in enumerate(biases):
        for t, v in (b or {}).items():
            expected[i, t] += v
    torch.testing.assert_close(biased, expected)
    assert biased is not logits and torch.equal(logits, logits.clone())  # input untouched
    assert apply_logit_bias(logits, [row()] * 3, owned=False) is logits  # no bias: no copy
    # +100 wins the greedy choice, -100 bans the favourite; the sampled distribution is
    # the reference's on the biased logits
    top = int(logits[1].argmax())
    assert sample(logits[1:2], [row(temperature=0.0, logit_bias={top: -100.0})]) != [top]
    assert sample(logits[:1], [row(temperature=0.0, logit_bias={3: 100.0})]) == [3]
    freq = frequencies(logits[2], 20000, logit_bias=biases[2])
    torch.testing.assert_close(freq, reference_probs(expected[2]), atol=0.015, rtol=0)
    with pytest.raises(ValueError, match="token id 50 "):
        apply_logit_bias(logits[:1], [row(logit_bias={50: 1.0})], owned=False)


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: float("nan")}, {-1: 1.0}, {"1": 1.0}, [1]])
def test_logit_bias_is_validated(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_crosses_to_the_workers_sampler():
    """The bias travels in the step's SamplingSpec (msgpack, int keys kept) to the sampler."""
    import msgspec

    from tokenmill.engine.scheduler import sampling_spec
    from tokenmill.platforms.step import SamplingSpec

    spec = sampling_spec(SamplingParams(temperature=0.0, logit_bias={3: 100.0, 4: -2.5}))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=SamplingSpec)
    assert decoded.logit_bias == {3: 100.0, 4: -2.5}
    r = SamplingRow(params=decoded, prompt_token_ids=[], output_token_ids=[], generator=None)
    assert sample(torch.zeros(1, VOCAB), [r]) == [3]
