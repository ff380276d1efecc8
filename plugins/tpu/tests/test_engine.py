"""The engine with the tpu platform runs its steps on the plugin's JAX runner (not the
core's torch graph), through `tokenmill_model_runner`, and its greedy tokens equal
transformers'; tensor parallel 4 over the mesh gives the same tokens."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill_tpu.runner import TpuModelRunner

PROMPTS = ["The quick brown fox", "Paris is the capital of France; Berlin is", "def main():"]


def _llm(path) -> LLM:
    return LLM(str(path), platform="tpu", dtype="float32", num_kv_blocks=64,
               max_num_batched_tokens=16)  # 16-token steps: chunked prefill mixed with decodes


@pytest.mark.parametrize("tp", ["1", "4"])
def test_engine_uses_the_jax_runner(tiny, hf_greedy, monkeypatch, tp):
    monkeypatch.setenv("TOKENMILL_TPU_TENSOR_PARALLEL", tp)
    path = tiny("llama")[2]
    llm = _llm(path)
    runner = llm.engine.executor.worker.runner
    assert isinstance(runner, TpuModelRunner) and runner.mesh.size == int(tp)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert runner.stats.steps > 0
    tokenizer = llm.engine.tokenizer
    for prompt, out in zip(PROMPTS, outputs):
        ids = tokenizer(prompt)["input_ids"]
        assert out.outputs[0].token_ids == hf_greedy("llama", ids, 6), prompt


def test_bad_tensor_parallel_setting_is_an_error(tiny, monkeypatch):
    monkeypatch.setenv("TOKENMILL_TPU_TENSOR_PARALLEL", "8")
    with pytest.raises(Exception, match="tensor_parallel_size=8 needs that many devices"):
        _llm(tiny("llama")[2])
