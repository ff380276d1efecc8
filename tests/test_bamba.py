"""Bamba (a Mamba2 hybrid) against transformers: the model's logits over our recurrent-
state arena, and greedy tokens end to end through `LLM` on the CPU plugin.

A tiny random Bamba (three Mamba2 layers, one attention layer, blocks of 4 tokens, SSD
chunks of 8, prompts up to ~50 tokens so every prompt spans several chunks and blocks)
must produce transformers' greedy tokens for single requests, mixed batches under a small
token budget (chunked prefill beside decodes), preemption, and prefix caching cold vs
warm (a warm hit restarts the recurrence from a checkpoint).
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, BambaConfig

from tokenmill import LLM, SamplingParams
from tokenmill_conformance.tiny_models import make_tokenizer

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "héllo wörld, naïve café, 你好世界 🙂 and then some more words to make this one long",
    "def main():\n    return 42\n tokenmill turns any accelerator into tokens, one step at a time.",
]
# pages in the preemption test: a few sequences' states and KV, not all four at once
NUM_TIGHT_BLOCKS = 200
SHARED = "Paris is the capital of France; Berlin is the capital of Germany. The quick brown fox "


def tiny_bamba_config(vocab_size: int) -> BambaConfig:
    return BambaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=8,
        max_position_embeddings=256,
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, the transformers model) of a tiny random Bamba."""
    path = tmp_path_factory.mktemp("bamba")
    tokenizer = make_tokenizer(300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_bamba_config(len(tokenizer)), dtype=torch.float32)
    with torch.no_grad():
        # peaked distributions, so greedy is not decided by float noise between near ties
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
            elif name.endswith(("dt_bias", "D", "conv1d.bias")):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # no eos: greedy runs on through it, as ignore_eos does
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return path, hf.eval()


_HF_CACHE: dict[tuple[int, ...], list[int]] = {}
_HF_MAX_NEW = 24


def _hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation (its chunked scan over the prompt, then its
    recurrence per token), computed once per prompt."""
    key = tuple(prompt_ids)
    if key not in _HF_CACHE:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max(max_new, _HF_MAX_NEW), do_sample=False)
        _HF_CACHE[key] = out[0, len(prompt_ids):].tolist()
    return _HF_CACHE[key][:max_new]


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    # few sequences and a small budget: the start-up profile step runs that many prompts
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 64, **kw}
    return LLM(str(path), dtype="float32", block_size=4, **kw)


def _expect(hf, llm: LLM, prompts: list[str], outs, max_new: int) -> None:
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, tok.encode(prompt), max_new), prompt


def test_single_requests_on_the_cpu_fast_path(tiny, caplog):
    path, hf = tiny
    with caplog.at_level(logging.WARNING, logger="tokenmill.model.layers"):
        llm = _llm(path)
    model = llm.engine.executor.worker.runner.model
    # the fast path must run: the plugin's Mamba2 backend, not the core's reference
    assert {b.name for b in model.attention_backends} == {"cpu_sdpa_full", "cpu_mamba2"}
    assert "core's reference" not in caplog.text
    for prompt in PROMPTS:
        _expect(hf, llm, [prompt], llm.generate([prompt], _greedy(), use_tqdm=False), 12)


def test_prompt_logprobs_match_transformers(tiny):
    """Every prompt position's log-probability of the next prompt token, prefilled in
    chunks of 8 across SSD chunk and block boundaries, against transformers' logits."""
    path, hf = tiny
    llm = _llm(path, max_num_batched_tokens=8, enable_prefix_caching=False)
    ids = llm.get_tokenizer().encode(PROMPTS[3])
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    expected = [float(want[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert got == pytest.approx(expected, abs=1e-4)


def test_mixed_batch_under_small_token_budget(tiny):
    path, hf = tiny
    # a budget of 8 splits prompts into chunks and mixes them with decodes
    llm = _llm(path, max_num_batched_tokens=8, max_num_seqs=3, enable_prefix_caching=False)
    _expect(hf, llm, PROMPTS, llm.generate(PROMPTS, _greedy(10), use_tqdm=False), 10)


def test_preemption_keeps_greedy_outputs(tiny):
    path, hf = tiny
    tight = _llm(path, num_kv_blocks=NUM_TIGHT_BLOCKS, max_model_len=128,
                 max_num_batched_tokens=16)
    outs = tight.generate(PROMPTS, _greedy(24), use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    _expect(hf, tight, PROMPTS, outs, 24)
    assert tight.engine.kv.usage == 0.0


def test_prefix_cache_cold_and_warm(tiny):
    """A warm request restarts every Mamba2 layer from a checkpoint at its hit boundary:
    the same prompt again (the prompt-end checkpoint) and an agent's next turn, which
    repeats the whole first turn (the checkpoint kept when the first turn ended)."""
    path, hf = tiny
    llm = _llm(path)
    tok = llm.get_tokenizer()
    first = tok.encode(SHARED + "def main():")
    cold = llm.generate({"prompt_token_ids": first}, _greedy(), use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    again = llm.generate({"prompt_token_ids": first}, _greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(first) - 1) // 4 * 4
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    turn = first + cold.outputs[0].token_ids + tok.encode(" héllo wörld")
    warm = llm.generate({"prompt_token_ids": turn}, _greedy(), use_tqdm=False)[0]
    # the first turn computed all but its last sampled token: its last full block ends there
    assert warm.num_cached_tokens == (len(first) + 12 - 1) // 4 * 4
    fresh = _llm(path, enable_prefix_caching=False)
    assert fresh.generate({"prompt_token_ids": turn}, _greedy(), use_tqdm=False)[0].outputs[
        0].token_ids == warm.outputs[0].token_ids
    assert cold.outputs[0].token_ids == _hf_greedy(hf, first, 12)
    assert warm.outputs[0].token_ids == _hf_greedy(hf, turn, 12)
