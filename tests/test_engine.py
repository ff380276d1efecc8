"""End to end through `LLM`: greedy equality with HF transformers, chunked prefill,
prefix caching, preemption, sampling and the API's errors, on tiny random models."""

import pytest
import torch
from tiny_models import load_hf

from tokenmill import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "héllo wörld, naïve café, 你好世界 🙂 and then some more words to make this one long",
    "def main():",
]


def hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def make_llm(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 4)
    return LLM(str(path), **kw)


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    return make_llm(tiny_dirs["llama"])


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3"])
def test_greedy_matches_transformers(tiny_dirs, arch):
    hf = load_hf(tiny_dirs[arch])
    llm = make_llm(tiny_dirs[arch])
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS[:2], greedy(), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        expected = hf_greedy(hf, tok.encode(prompt), 12)
        assert out.outputs[0].token_ids == expected, prompt


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_under_small_token_budget(tiny_dirs, arch):
    hf = load_hf(tiny_dirs[arch])
    # a budget of 8 splits prompts into chunks and mixes them with decodes
    llm = make_llm(tiny_dirs[arch], max_num_batched_tokens=8, max_num_seqs=3)
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, greedy(10), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, tok.encode(prompt), 10), prompt


def test_long_prefill_threshold_is_the_platforms_unless_given(tiny_dirs):
    from tokenmill.platforms.registry import PlatformRegistry
    from tokenmill_conformance import reference_platform

    def threshold(llm: LLM) -> int:
        return llm.engine.scheduler.config.long_prefill_token_threshold

    # the CPU plugin cuts long prompts into 512-token chunks; an explicit argument wins
    assert threshold(make_llm(tiny_dirs["llama"])) == 512
    assert threshold(make_llm(tiny_dirs["llama"], long_prefill_token_threshold=0)) == 0
    assert threshold(make_llm(tiny_dirs["llama"], long_prefill_token_threshold=64)) == 64
    # a platform that names none: no limit but the step's budget
    registry = PlatformRegistry()
    registry.register_plugin(reference_platform, "tokenmill-reference")
    on_reference = make_llm(tiny_dirs["llama"], platform="tokenmill-reference", registry=registry)
    assert threshold(on_reference) == 0


def test_prefix_caching_same_outputs_and_counts_hits(tiny_dirs):
    shared = "Paris is the capital of France; Berlin is the capital of Germany. "
    prompts = [shared + s for s in ("The quick", "def main():", "héllo")]
    on = make_llm(tiny_dirs["llama"], enable_prefix_caching=True)
    off = make_llm(tiny_dirs["llama"], enable_prefix_caching=False)
    first = on.generate(prompts[0], greedy(), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    rest_on = on.generate(prompts[1:], greedy(), use_tqdm=False)
    rest_off = off.generate(prompts[1:], greedy(), use_tqdm=False)
    n_shared = len(on.get_tokenizer().encode(shared))
    for a, b in zip(rest_on, rest_off):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.num_cached_tokens == (n_shared - 1) // 4 * 4 > 0 or a.num_cached_tokens >= 4
        assert b.num_cached_tokens == 0
    # the same prompt again hits everything but the last (partial) block
    again = on.generate(prompts[0], greedy(), use_tqdm=False)[0]
    n = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (n - 1) // 4 * 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_keeps_outputs_identical(tiny_dirs):
    roomy = make_llm(tiny_dirs["llama"])
    tight = make_llm(tiny_dirs["llama"], num_kv_blocks=32, max_model_len=128)
    params = [greedy(24), SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)]
    prompts = PROMPTS * 2
    plist = [params[i % 2] for i in range(len(prompts))]
    a = roomy.generate(prompts, plist, use_tqdm=False)
    b = tight.generate(prompts, plist, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert tight.engine.kv.usage == 0.0
    # prompt logprobs survive preemption without repeats
    lp = greedy(24, prompt_logprobs=1)
    before = tight.engine.scheduler.num_preemptions
    c = tight.generate(prompts, [lp] * len(prompts), use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > before
    for prompt_out in c:
        assert len(prompt_out.prompt_logprobs) == len(prompt_out.prompt_token_ids)
        assert all(
            prompt_out.prompt_token_ids[i] in prompt_out.prompt_logprobs[i]
            for i in range(1, len(prompt_out.prompt_token_ids))
        )


def test_seeded_sampling_reproducible_and_batch_independent(llama):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llama.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0].token_ids
    batch = llama.generate(
        PROMPTS, [p, *[SamplingParams(temperature=1.0, max_tokens=16)] * 3], use_tqdm=False
    )[0].outputs[0].token_ids
    assert alone == batch
    other = llama.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert other[0].outputs[0].token_ids != alone


def test_stop_string_split_across_tokens(llama):
    tok = llama.get_tokenizer()
    free = llama.generate(PROMPTS[1], greedy(16), use_tqdm=False)[0].outputs[0]
    # pick a stop string that straddles the boundary between output tokens 3 and 4
    pieces = [tok.decode(free.token_ids[:i]) for i in range(8)]
    stop = pieces[5][len(pieces[3]) - 1 : len(pieces[3]) + 1]
    assert len(stop) == 2 and stop not in pieces[3]
    out = llama.generate(PROMPTS[1], greedy(16, stop=[stop]), use_tqdm=False)[0].outputs[0]
    cut = free.text.index(stop)
    assert out.text == free.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    incl = llama.generate(
        PROMPTS[1], greedy(16, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert incl.text == free.text[: cut + len(stop)]


def test_stop_token_ids_max_tokens_and_eos(llama):
    free = llama.generate(PROMPTS[0], greedy(8), use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    out = llama.generate(PROMPTS[0], greedy(8, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert free.finish_reason == "length" and len(free.token_ids) == 8


def test_n_logprobs_and_prompt_logprobs_match_transformers(tiny_dirs, llama):
    hf = load_hf(tiny_dirs["llama"])
    tok = llama.get_tokenizer()
    ids = tok.encode(PROMPTS[1])
    out = llama.generate(
        {"prompt_token_ids": ids}, greedy(4, logprobs=3, prompt_logprobs=2), use_tqdm=False
    )[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + out.outputs[0].token_ids])).logits[0], -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        lp = out.prompt_logprobs[pos]
        assert ids[pos] in lp
        assert lp[ids[pos]].logprob == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
    for i, (tid, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        pos = len(ids) - 1 + i
        assert lp[tid].rank == 1 and len(lp) == 3  # greedy: sampled token is the top-1
        top = ref[pos].topk(3)
        assert sorted(lp) == sorted(top.indices.tolist())
        assert lp[tid].logprob == pytest.approx(float(top.values[0]), abs=1e-4)
    many = llama.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6), use_tqdm=False)[0]
    assert [o.index for o in many.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in many.outputs}) > 1


def test_chat_uses_template(llama):
    out = llama.chat([{"role": "user", "content": "hi"}], greedy(4), use_tqdm=False)[0]
    text = llama.get_tokenizer().decode(out.prompt_token_ids)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi" in text
    two = llama.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], greedy(2), use_tqdm=False)
    assert len(two) == 2


def test_bad_arguments_name_the_value(tiny_dirs, llama):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=float("nan"))
    with pytest.raises(ValueError, match="no_such_arg"):
        LLM(str(tiny_dirs["llama"]), no_such_arg=1)
    with pytest.raises(ValueError, match="bfloat8|dtype"):
        LLM(str(tiny_dirs["llama"]), dtype="bfloat8")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llama.generate({"prompt_token_ids": [1, 10**6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="over the context"):
        llama.generate("hi", SamplingParams(max_tokens=10**5), use_tqdm=False)
    with pytest.raises(TypeError, match="unsupported prompt"):
        llama.generate([42], use_tqdm=False)
    # the engine still works after rejected requests
    assert llama.generate("hi", greedy(2), use_tqdm=False)[0].outputs[0].token_ids
    assert not llama.engine.has_unfinished_requests()


def test_a_request_that_fails_ends_alone_with_an_error(llama, caplog):
    """A failure while processing one request's output (here its detokenizer raises) ends
    that request with finish_reason "error"; the others finish with the same tokens as
    when they run alone, and the engine keeps serving."""
    engine = llama.engine
    tok = llama.get_tokenizer()
    alone = {
        p: llama.generate(p, greedy(10), use_tqdm=False)[0].outputs[0].token_ids
        for p in PROMPTS[:3]
    }
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"iso-{i}", tok.encode(prompt), greedy(10), prompt=prompt)

    def broken(token_ids):
        raise RuntimeError("detokenizer exploded")

    engine.outputs.parents["iso-1"].seqs[0].detokenizer.append = broken
    finished = {}
    with caplog.at_level("ERROR"):
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0]
    assert finished["iso-1"].finish_reason == "error"
    assert "detokenizer exploded" in finished["iso-1"].stop_reason
    assert "iso-1" in caplog.text
    for i in (0, 2):
        assert finished[f"iso-{i}"].finish_reason == "length"
        assert finished[f"iso-{i}"].token_ids == alone[PROMPTS[i]]
    again = llama.generate(PROMPTS[1], greedy(10), use_tqdm=False)[0].outputs[0]
    assert again.token_ids == alone[PROMPTS[1]]
    assert engine.scheduler.kv.usage == 0.0  # the failed request's blocks were freed too


def test_a_request_is_validated_once_at_the_front(llama, monkeypatch):
    """`add_request` checks the prompt once for the request (not once per sequence of an
    n > 1 request, not again in the engine core's `add_core_request`); what it refuses is
    refused there, with the value named, and never reaches the scheduler."""
    import tokenmill.engine.llm_engine as llm_engine

    checked = []
    real = llm_engine.check_prompt
    monkeypatch.setattr(llm_engine, "check_prompt", lambda *a: checked.append(a[0]) or real(*a))
    params = SamplingParams(temperature=0.8, max_tokens=3, n=3, seed=1)
    out = llama.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(out[0].outputs) == 3 and checked == [[5, 6, 7]]
    with pytest.raises(ValueError, match=r"prompt token ids \[99999\] are outside"):
        llama.engine.add_request("bad", [99999], SamplingParams(max_tokens=2))
    assert "bad" not in llama.engine.scheduler.requests
