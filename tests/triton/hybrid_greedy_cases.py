"""End to end on the nvidia plugin: greedy tokens of the tiny Kimi Linear (KDA + MLA layers)
and Bamba (Mamba2 + full attention) models through `LLM`, every layer on the plugin's
Triton kernels (KDA and Mamba2 on the LINEAR backend's kernels, not the core's reference),
against transformers' own greedy continuation. Prompts are prefilled in chunks of 8 beside
decodes (the recurrent states carried across chunks), with prefix caching on. Run by
test_triton_kernels.py in a fresh process (TRITON_INTERPRET=1 without a GPU).
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill_conformance.tiny_models import make_config, make_tokenizer

PROMPTS = ["The quick brown fox", "Paris is the capital of France; Berlin is the capital of"]
MAX_NEW = 5


def _tiny_model(path, arch: str):
    """The suite's tiny `arch` model (tiny_models.make_tiny_model's config and init), with
    untied embeddings: transformers' KimiLinear keeps its own lm_head even when the config
    says tie_word_embeddings (which the suite's config does), so only untied weights give
    one model to both sides."""
    tokenizer = make_tokenizer(300)
    config = make_config(arch, len(tokenizer))
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _transformers_greedy(path, prompt_ids: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # greedy runs on through it, as ignore_eos
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_NEW,
                             do_sample=False)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("arch", ["kimi_linear", "bamba"])  # variants kda, mamba2
def test_greedy_on_the_triton_kernels_matches_transformers(tmp_path, caplog, arch):
    path = _tiny_model(tmp_path / arch, arch)
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        llm = LLM(str(path), platform="nvidia", dtype="float32", block_size=16,
                  num_kv_blocks=256, max_num_seqs=2, max_num_batched_tokens=8)
    model = llm.engine.executor.worker.runner.model
    names = {b.name for b in model.attention_backends}
    assert "nvidia_triton_linear" in names, names
    assert not any(n.startswith("reference") for n in names), names
    assert "core's reference" not in caplog.text, caplog.text
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = _transformers_greedy(path, tok.encode(prompt))
        assert out.outputs[0].token_ids == want, (arch, prompt)
