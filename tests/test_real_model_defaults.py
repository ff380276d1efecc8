"""A new user's first question to the embedded default model (SmolLM2-135M-Instruct),
with no sampling settings: the shipped generation defaults apply (issue 12 §6)."""

import pytest

from tokenmill import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM()  # what a new user types: the default model, dtype and settings


@pytest.mark.slow
def test_the_default_model_samples_with_its_recommended_settings(llm):
    assert llm.engine.generation_defaults == {"temperature": 0.2, "top_p": 0.9}
    out = llm.chat(QUESTION, use_tqdm=False)[0]
    assert out.outputs[0].text and out.finished


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="the model, not tokenmill: with the model card's settings (temperature 0.2, top_p "
    "0.9) tokenmill answers Paris 11 of 20 seeds (bf16; 13 in float32), and llama.cpp, the GGUF's native "
    "runtime, on the same GGUF and the same prompt ids answers it 2 of 20 (at its "
    "create_chat_completion defaults and at 0.2 / 0.9 alike; 15 of 20 open \"L'Étoile,\"). "
    "First-token logprobs, same top 5 in the same order: llama.cpp L -1.94, The -2.29, La "
    "-2.40, Al -2.53, Le -2.79; tokenmill bf16 L -1.83, The -1.83, La -2.33, Al -2.83, Le "
    "-2.83 (float32 The -1.88, L -1.96, as transformers gives). 'The' leads to Paris, 'L' "
    "to \"L'Étoile...\". Reproduce: benchmarks/llamacpp_first_question.py; docs/server.md",
)
def test_a_new_user_gets_paris_nearly_every_time(llm):
    # the seed only picks the random stream; every sampling setting is left to the model
    outs = llm.chat([QUESTION] * 10, [SamplingParams(seed=s) for s in range(10)], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert sum("Paris" in t for t in texts) >= 9, texts
