"""Kimi Linear (KDA + MLA layers, DeepSeek-V3's MoE) through the engine against transformers.

A tiny random `kimi_linear` (KDA and MLA layers alternating, a dense layer then MoE
layers; saved with `save_pretrained`, i.e. Kimi's checkpoint names: `block_sparse_moe`,
experts' w1/w2/w3, separate q/k/v convs) must give transformers' greedy tokens through
`LLM` on the CPU plugin (KDA as variant "kda" of the linear-attention backend, its states
in the arena beside the MLA latent pages) for single requests, a mixed batch under a small
token budget (chunked prefill: the recurrent state carried across chunks), preemption,
and prefix caching cold vs warm (a hit resumes KDA from a checkpoint).
"""

from __future__ import annotations

import pytest
import torch
from test_deepseek_v3 import PROMPTS, SHARED, _expect, _greedy
from transformers import AutoModelForCausalLM, KimiLinearConfig

from tokenmill import LLM
from tokenmill.platforms.interfaces import AttentionKind
from tokenmill_conformance.tiny_models import make_tokenizer


def tiny_config(vocab_size: int) -> KimiLinearConfig:
    return KimiLinearConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        num_local_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2, kv_lora_rank=32,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=256, eos_token_id=2, bos_token_id=None, pad_token_id=0,
        linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4},
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear")
    tokenizer = make_tokenizer(300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(len(tokenizer)), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "A_log" not in name:
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, hf.eval()


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, **{"max_num_batched_tokens": 64, **kw})


def test_single_requests(tiny):
    path, hf = tiny
    llm = _llm(path)
    kinds = [g.kind for g in llm.engine.kv.groups]
    assert set(kinds) == {AttentionKind.LINEAR, AttentionKind.MLA}
    names = {b.name for b in llm.engine.executor.worker.runner.model.attention_backends}
    assert "cpu_mla" in names and "reference_mla" not in names
    for prompt in PROMPTS[1:3]:
        _expect(hf, llm, [prompt], llm.generate([prompt], _greedy(10), use_tqdm=False), 10)


def test_mixed_batch_under_small_token_budget(tiny):
    path, hf = tiny
    llm = _llm(path, max_num_batched_tokens=8, max_num_seqs=3, enable_prefix_caching=False)
    _expect(hf, llm, PROMPTS, llm.generate(PROMPTS, _greedy(6), use_tqdm=False), 6)


def test_preemption_keeps_greedy_outputs(tiny):
    path, hf = tiny
    tight = _llm(path, num_kv_blocks=60, max_model_len=128, max_num_batched_tokens=16)
    outs = tight.generate(PROMPTS, _greedy(16), use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    _expect(hf, tight, PROMPTS, outs, 16)


def test_prefix_cache_cold_and_warm(tiny):
    path, hf = tiny
    llm = _llm(path)
    prompts = [SHARED + s for s in ("def main():", "héllo wörld", "one step at a time")]
    cold = llm.generate(prompts[0], _greedy(8), use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    warm = llm.generate(prompts[1:], _greedy(8), use_tqdm=False)
    assert all(out.num_cached_tokens > 8 for out in warm), [o.num_cached_tokens for o in warm]
    again = llm.generate(prompts[0], _greedy(8), use_tqdm=False)[0]
    assert again.num_cached_tokens > 8
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    _expect(hf, llm, prompts, [cold, *warm], 8)


def test_a_tied_config_keeps_its_own_head_as_transformers_does(tmp_path):
    """transformers' Kimi Linear never ties its LM head (no tied weights declared), even
    when the config says `tie_word_embeddings=True`: the head saved is its own."""
    tokenizer = make_tokenizer(300)
    config = tiny_config(len(tokenizer))
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "A_log" not in name:
                p.normal_(0, 0.15)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    llm = _llm(tmp_path)
    prompt = PROMPTS[1]
    _expect(hf, llm, [prompt], llm.generate([prompt], _greedy(6), use_tqdm=False), 6)
