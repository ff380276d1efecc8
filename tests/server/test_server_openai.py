"""The `openai` SDK against a real server on a tiny random model; outputs are checked
against the offline `LLM` on the same model."""

from __future__ import annotations

import openai
import pytest
from conftest import TINY_NAME

from tokenmill import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over"
CHAT = [{"role": "user", "content": "Paris is the capital of"}]


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(str(tiny_model), dtype="float32", block_size=4, num_kv_blocks=4096)


def greedy(max_tokens=12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def offline_text(offline: LLM, prompt: str = PROMPT, **kw) -> str:
    return offline.generate(prompt, greedy(**kw), use_tqdm=False)[0].outputs[0].text


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [TINY_NAME]


def test_completion_greedy_matches_offline(client, offline):
    r = client.completions.create(
        model=TINY_NAME, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == offline_text(offline)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(offline.get_tokenizer().encode(PROMPT))


def test_chat_greedy_matches_offline(client, offline):
    expected = offline.chat(CHAT, greedy(10), use_tqdm=False)[0].outputs[0].text
    r = client.chat.completions.create(
        model=TINY_NAME, messages=CHAT, max_completion_tokens=10, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.usage.completion_tokens == 10


def test_completion_stream_matches_non_stream(client, offline):
    chunks = list(client.completions.create(
        model=TINY_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline_text(offline)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_stream_with_usage(client, offline):
    expected = offline.chat(CHAT, greedy(10), use_tqdm=False)[0].outputs[0].text
    chunks = list(client.chat.completions.create(
        model=TINY_NAME, messages=CHAT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    usage = chunks[-1].usage
    assert usage.completion_tokens == 10 and usage.total_tokens == usage.prompt_tokens + 10
    assert all(c.usage is None for c in chunks[:-1])


def test_n_with_seed_is_reproducible(client):
    def run():
        r = client.chat.completions.create(
            model=TINY_NAME, messages=CHAT, max_tokens=8, temperature=1.0, n=3, seed=7,
            extra_body={"ignore_eos": True},
        )
        return sorted((c.index, c.message.content) for c in r.choices)

    first = run()
    assert [i for i, _ in first] == [0, 1, 2]
    assert len({t for _, t in first}) > 1  # different samples per choice
    assert run() == first


def test_n_streaming_completion_multi_prompt(client, offline):
    prompts = [PROMPT, "Berlin is the capital of"]
    chunks = list(client.completions.create(
        model=TINY_NAME, prompt=prompts, max_tokens=6, temperature=0, n=2, stream=True,
        extra_body={"ignore_eos": True},
    ))
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        expected = offline_text(offline, prompt, max_tokens=6)
        assert texts[2 * i] == texts[2 * i + 1] == expected


def test_completion_logprobs(client):
    r = client.completions.create(
        model=TINY_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the top token


def test_chat_logprobs_stream(client):
    chunks = list(client.chat.completions.create(
        model=TINY_NAME, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, stream=True, extra_body={"ignore_eos": True},
    ))
    content = [t for c in chunks if c.choices and c.choices[0].logprobs
               for t in c.choices[0].logprobs.content]
    assert len(content) == 6
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)


def test_stop_string_truncates_in_stream_and_not(client, offline):
    full = offline_text(offline, max_tokens=16)
    stop = full[5:8]
    assert stop and stop not in full[:7]
    body = dict(model=TINY_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                extra_body={"ignore_eos": True})
    r = client.completions.create(**body)
    expected = full[: full.index(stop)]
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))
    assert streamed == expected


def test_vllm_extras(client, offline):
    out = offline.generate(PROMPT, greedy(8), use_tqdm=False)[0].outputs[0]
    stop_id = out.token_ids[3]
    first = out.token_ids.index(stop_id)
    r = client.completions.create(
        model=TINY_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "top_k": 5, "min_p": 0.0,
                    "repetition_penalty": 1.0, "cache_salt": "tenant-a"},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == first + 1
    r = client.completions.create(
        model=TINY_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"stop_token_ids": [stop_id], "min_tokens": 8},
    )
    assert r.usage.completion_tokens == 8  # min_tokens overrides the stop token


def test_usage_reports_cached_prompt_tokens(client):
    prompt = "Paris is the capital of France; Berlin is the capital of Germany. " * 3
    body = dict(model=TINY_NAME, prompt=prompt, max_tokens=2, temperature=0)
    client.completions.create(**body)
    r = client.completions.create(**body)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < r.usage.prompt_tokens
    salted = client.completions.create(**body, extra_body={"cache_salt": "another-tenant"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_delta_text_never_sends_what_a_stop_cuts():
    from tokenmill.server.serving import DeltaText

    # cumulative texts as the engine grows them; the stop "STOP" completes in the last step
    # and the engine cuts the text where it began
    steps = ["ab", "abcS", "abcST", "abcSTO"]
    delta = DeltaText(max_stop_len=len("STOP"))
    sent = "".join(delta.next(t, finished=False) for t in steps)
    sent += delta.next("abc", finished=True)
    assert sent == "abc"
    delta = DeltaText(max_stop_len=0)
    assert [delta.next(t, False) for t in ("a", "ab")] + [delta.next("abc", True)] == ["a", "b", "c"]


def test_seeded_sampling_matches_offline(client, offline):
    """Every sampling field reaches the engine as the offline API would pass it."""
    fields = dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.1,
                  presence_penalty=0.5, frequency_penalty=0.3, seed=123, n=2, max_tokens=10)
    params = SamplingParams(ignore_eos=True, **fields)
    expected = [o.text for o in offline.generate(PROMPT, params, use_tqdm=False)[0].outputs]
    extra = {k: fields.pop(k) for k in ("top_k", "min_p", "repetition_penalty")}
    r = client.completions.create(model=TINY_NAME, prompt=PROMPT, **fields,
                                  extra_body={**extra, "ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == expected
    assert expected[0] != expected[1]
