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
    reason="the model card's settings (temperature 0.2, top_p 0.9) answer Paris 5 of 10 "
    "times (bf16), 6 of 10 (float32): this Q4_1 135M model puts nearly equal probability "
    "on 'The' (-> Paris) and 'L' (-> \"L'Étoile...\") as the first token (float32 "
    "logprobs -1.88 / -1.96, as transformers gives on the same GGUF; tied in bf16)",
)
def test_a_new_user_gets_paris_nearly_every_time(llm):
    # the seed only picks the random stream; every sampling setting is left to the model
    outs = llm.chat([QUESTION] * 10, [SamplingParams(seed=s) for s in range(10)], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert sum("Paris" in t for t in texts) >= 9, texts
