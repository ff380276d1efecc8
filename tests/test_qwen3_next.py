"""Qwen3-Next end to end through `LLM` on the CPU plugin, against transformers.

A tiny random model (3 Gated DeltaNet layers and 1 gated full-attention layer, MoE with
a shared expert and one dense layer, blocks of 4) must give transformers' greedy tokens
for single requests, a mixed batch under a small token budget (chunked prefill beside
decodes), preemption, and prefix caching cold vs warm: the same prompt again (the
prompt-end checkpoint) and an agent's next turn that repeats the conversation (the
rolling checkpoint at the end of the previous output); and, under a tight pool, a retry
that benefit eviction keeps hitting where LRU does not. Few tokens, so it stays fast.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3NextConfig

from tokenmill import LLM, SamplingParams
from tokenmill.kv.recurrent import RecurrentStateAllocator
from tokenmill_conformance.tiny_models import make_tokenizer

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "def main():\n    return 42\n tokenmill turns any accelerator into tokens",
]
MAX_NEW = 8


def tiny_qwen3_next_config(vocab_size: int) -> Qwen3NextConfig:
    return Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], max_position_embeddings=256, eos_token_id=2, bos_token_id=None,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, the transformers model)."""
    path = tmp_path_factory.mktemp("qwen3_next")
    tokenizer = make_tokenizer(300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_next_config(len(tokenizer)),
                                             dtype=torch.float32)
    with torch.no_grad():
        # peaked distributions (greedy not decided by float noise), non-trivial norms
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
            elif name.endswith("linear_attn.norm.weight"):
                p.normal_(1, 0.3)
            elif "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, hf.eval()


_HF: dict[tuple[int, ...], list[int]] = {}


def _hf_greedy(model, prompt_ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    """transformers' greedy continuation, recomputing the whole sequence each token (its
    own cache plays no part)."""
    key = tuple(prompt_ids)
    if key not in _HF:
        ids, out = torch.tensor([prompt_ids]), []
        with torch.no_grad():
            for _ in range(MAX_NEW):
                out.append(int(model(ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
        _HF[key] = out
    return _HF[key][:max_new]


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, **kw)


def _check(hf, llm: LLM, prompts, outs, max_new: int = MAX_NEW) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        ids = prompt if isinstance(prompt, list) else llm.get_tokenizer().encode(prompt)
        assert out.outputs[0].token_ids == _hf_greedy(hf, ids, max_new), prompt


@pytest.fixture(scope="module")
def llm(tiny):
    return _llm(tiny[0], num_kv_blocks=512)


def test_single_requests_and_the_arena_layout(tiny, llm):
    _, hf = tiny
    kv = llm.engine.kv
    assert [a.__class__ for a in kv.allocators].count(RecurrentStateAllocator) == 3
    # the fast path runs: the CPU plugin's own linear backend, not the core's reference
    model = llm.engine.executor.worker.runner.model
    assert {b.name for b in model.attention_backends} == {"cpu_sdpa_full", "cpu_linear"}
    for prompt in PROMPTS:
        _check(hf, llm, [prompt], llm.generate([prompt], _greedy(), use_tqdm=False))
    assert kv.usage == 0.0


def test_mixed_batch_under_small_token_budget(tiny):
    path, hf = tiny
    llm = _llm(path, num_kv_blocks=512, max_num_batched_tokens=8, max_num_seqs=3,
               enable_prefix_caching=False)
    _check(hf, llm, PROMPTS, llm.generate(PROMPTS, _greedy(), use_tqdm=False))


def test_preemption_keeps_greedy_outputs(tiny):
    path, hf = tiny
    tight = _llm(path, num_kv_blocks=76, max_model_len=56, max_num_batched_tokens=16)
    outs = tight.generate(PROMPTS, _greedy(), use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    _check(hf, tight, PROMPTS, outs)
    assert tight.engine.kv.usage == 0.0


def test_prefix_cache_cold_and_warm(tiny, llm):
    """Same prompt again: hit at the prompt-end checkpoint. An agent's next turn (the
    conversation so far + new tokens): hit at the rolling checkpoint, the last block
    boundary of the previous output. Outputs equal cold ones and transformers'."""
    _, hf = tiny
    prompt = llm.get_tokenizer().encode(PROMPTS[2])
    cold = llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(prompt) - 1) // 4 * 4 > 0
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    history = prompt + list(cold.outputs[0].token_ids)
    turn = history + llm.get_tokenizer().encode(" and then")
    out = llm.generate({"prompt_token_ids": turn}, _greedy(4), use_tqdm=False)[0]
    # the last output token was sampled, never computed: the state covers history[:-1]
    assert out.num_cached_tokens == (len(history) - 1) // 4 * 4
    assert out.num_cached_tokens > len(prompt)
    _check(hf, llm, [prompt], [cold])
    _check(hf, llm, [turn], [out], 4)


def test_live_split_between_attention_types(tiny, llm):
    """While a request runs, the stats show the blocks each type holds (the /metrics
    split): full attention grows with the context, the recurrent groups hold their slots
    (3 groups x 4 pages) plus the checkpoints being written."""
    engine = llm.engine
    prompt = llm.get_tokenizer().encode(PROMPTS[1])
    engine.add_request("split", prompt, _greedy(4))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.scheduler_stats()
        if engine.scheduler.num_running:
            seen.append(stats.kv_blocks_by_type)
            per_group = engine.kv.blocks_in_use_per_group()
            assert stats.kv_blocks_by_type == {"linear": sum(per_group[:3]), "full": per_group[3]}
    assert seen and all(s["full"] >= -(-len(prompt) // 4) and s["linear"] >= 12 for s in seen)
    assert engine.scheduler_stats().kv_blocks_by_type == {"linear": 0, "full": 0}



def test_benefit_eviction_keeps_the_checkpoint_lru_evicts(tiny):
    """A prompt, another one, then a long cold request that presses the pool, then the
    first prompt again (a retry, a parallel sample). LRU evicts the first prompt's
    prompt-end checkpoint (the oldest freed pages: freed when that prompt was written) and
    keeps attention blocks useless without it: the retry hits less. Benefit eviction
    reuses the pages holding nothing first (superseded rolling checkpoints, slots), then
    the cheapest segments (output tokens' blocks with their rolling checkpoints, the
    shorter prompt's: little recompute for 12 checkpoint pages each), and the retry hits
    the whole prompt. Greedy outputs equal the cold run's and
    transformers' under both."""
    path, hf = tiny
    hits, evicted = {}, {}
    for eviction in ("benefit", "lru"):
        llm = _llm(path, num_kv_blocks=80, kv_eviction=eviction, max_num_batched_tokens=16)
        kv = llm.engine.kv
        prompt = llm.get_tokenizer().encode(PROMPTS[2])
        cold = llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0]
        llm.generate(PROMPTS[1], _greedy(), use_tqdm=False)  # cached pages of its own
        cached = {b.block_id for b in kv.pool.free_blocks() if b.block_hash is not None}
        other = [(7 * i + 3) % 280 + 10 for i in range(llm.engine.max_model_len - 1)]
        llm.generate({"prompt_token_ids": other}, _greedy(1), use_tqdm=False)
        evicted[eviction] = len(cached - {b.block_id for b in kv.pool.blocks if b.block_hash})
        retry = llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0]
        hits[eviction] = retry.num_cached_tokens
        assert retry.outputs[0].token_ids == cold.outputs[0].token_ids
        _check(hf, llm, [prompt], [retry])
        assert kv.usage == 0.0
    assert evicted["benefit"] > 0, evicted  # the pressure reached cached pages
    assert hits["benefit"] == (len(prompt) - 1) // 4 * 4 > hits["lru"], (hits, evicted)
