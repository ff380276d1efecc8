"""DeepSeek-V3 (MLA + group-limited sigmoid MoE with shared experts) against transformers.

A tiny random `deepseek_v3` (q LoRA, 4 heads, kv_lora_rank 32, rope 8 interleaved, 8
routed experts in 4 groups with 2 groups kept, a shared expert, one dense layer first,
a random correction bias so that it moves the choice) is saved with `save_pretrained`
(one tensor per expert, as real checkpoints) and must give transformers' logits through
the model harness with the core's reference MLA, and its greedy tokens through `LLM` on
the CPU plugin (whose MLA backend must be the one that runs) for single requests, a mixed
batch under a small token budget, preemption, and prefix caching cold vs warm.
"""

from __future__ import annotations

import pytest
import torch
from model_harness import PagedHarness
from transformers import AutoModelForCausalLM, DeepseekV3Config

from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import build_model, checkpoint_weights, load_model_info
from tokenmill.model.moe import select_experts
from tokenmill.platforms.interfaces import AttentionKind
from tokenmill.platforms.ops import resolve_ops
from tokenmill.platforms.ops.mla import ReferenceMLABackend
from tokenmill_conformance.tiny_models import make_tokenizer
from tokenmill_cpu.mla import CpuMLAAttention

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "héllo wörld, naïve café, 你好世界 🙂 and then some more words to make this one long",
    "def main():\n    return 42\n tokenmill turns any accelerator into tokens, one step at a time.",
]
SHARED = "Paris is the capital of France; Berlin is the capital of Germany. The quick brown fox "


def tiny_config(vocab_size: int, **overrides) -> DeepseekV3Config:
    """The tiny DeepSeek-V3 of these tests (also used by other tests and helpers)."""
    config = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256,
        eos_token_id=2, bos_token_id=None, pad_token_id=0,
    )
    return DeepseekV3Config(**{**config, **overrides})


def save_tiny(path, config, tokenizer) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # peaked distributions, so greedy is not decided by float noise between near ties
        for _, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    tokenizer = make_tokenizer(300)
    save_tiny(path, tiny_config(len(tokenizer)), tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return path, hf.eval()


_HF_CACHE: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def _hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation, decoding over its own KV cache (computed once
    per prompt: a shorter greedy continuation is a prefix of a longer one)."""
    key = (model.config.name_or_path, tuple(prompt_ids))  # the checkpoint, never id(model)
    if len(_HF_CACHE.get(key, ())) < max_new:
        out, cache, ids = [], None, torch.tensor([prompt_ids])
        with torch.no_grad():
            for _ in range(max(max_new, 16)):
                result = model(ids, past_key_values=cache, use_cache=True)
                cache = result.past_key_values
                out.append(int(result.logits[0, -1].argmax()))
                ids = torch.tensor([[out[-1]]])
        _HF_CACHE[key] = out
    return _HF_CACHE[key][:max_new]


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    # a small step budget keeps the start-up profiling step (and the test) short
    return LLM(str(path), dtype="float32", block_size=4, **{"max_num_batched_tokens": 64, **kw})


def _expect(hf, llm: LLM, prompts, outs, max_new: int) -> None:
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, tok.encode(prompt), max_new), prompt


def test_routing_equals_transformers_router(tiny):
    """Group-limited sigmoid top-k with the correction bias, on real router weights."""
    _, hf = tiny
    gate = hf.model.layers[1].mlp.gate
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    _, want_w, want_ids = gate(x)
    weights, ids = select_experts(
        torch.nn.functional.linear(x, gate.weight), 2, "sigmoid_group_topk", True,
        correction_bias=gate.e_score_correction_bias, num_groups=4, topk_group=2,
        routed_scaling_factor=2.5,
    )
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order))
    # the bias and the group limit both matter here: without them other experts win
    plain, plain_ids = select_experts(
        torch.nn.functional.linear(x, gate.weight), 2, "sigmoid_group_topk", True,
        num_groups=1, topk_group=1, routed_scaling_factor=2.5,
    )
    assert not torch.equal(plain_ids.sort(-1).values, ids.sort(-1).values)


def test_logits_through_the_harness_with_the_reference_mla(tiny):
    path, hf = tiny
    info = load_model_info(str(path))
    model = build_model(
        info.hf_config, checkpoint_weights(info.model_path, info.hf_config),
        dtype=torch.float32, device="cpu", ops=resolve_ops(),
        attention_backend=ReferenceMLABackend(), block_size=4,
    )
    assert [g.kind for g in model.kv_layout.groups] == [AttentionKind.MLA]
    harness = PagedHarness(model, ReferenceMLABackend())
    tokens = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()
              for n in (17, 9)]
    a, b = harness.add(tokens[0]), harness.add(tokens[1])
    # a prefill in chunks beside a prompt, then decodes of both (absorbed form)
    logits = harness.run(
        [[(a, 7), (b, 5)], [(b, 4), (a, 6)], [(a, 1)], [(a, 1)], [(a, 1)], [(a, 1)]]
    )
    with torch.no_grad():
        for seq in (a, b):
            want = hf(torch.tensor([seq.token_ids[: seq.num_computed]])).logits[0]
            torch.testing.assert_close(logits[id(seq)], want, atol=1e-4, rtol=0)


def test_single_requests_on_the_cpu_mla_backend(tiny):
    path, hf = tiny
    llm = _llm(path)
    model = llm.engine.executor.worker.runner.model
    assert {type(b) for b in model.attention_backends} == {CpuMLAAttention}
    assert [g.kind for g in llm.engine.kv.groups] == [AttentionKind.MLA]
    for prompt in PROMPTS[1:]:
        _expect(hf, llm, [prompt], llm.generate([prompt], _greedy(10), use_tqdm=False), 10)


def test_mixed_batch_under_small_token_budget(tiny):
    path, hf = tiny
    llm = _llm(path, max_num_batched_tokens=8, max_num_seqs=3, enable_prefix_caching=False)
    _expect(hf, llm, PROMPTS, llm.generate(PROMPTS, _greedy(8), use_tqdm=False), 8)


def test_preemption_keeps_greedy_outputs(tiny):
    path, hf = tiny
    tight = _llm(path, num_kv_blocks=36, max_model_len=128, max_num_batched_tokens=16)
    outs = tight.generate(PROMPTS, _greedy(16), use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    _expect(hf, tight, PROMPTS, outs, 16)
    assert tight.engine.kv.usage == 0.0


def test_prefix_cache_cold_and_warm(tiny):
    path, hf = tiny
    llm = _llm(path)
    prompts = [SHARED + s for s in ("def main():", "héllo wörld", "one step at a time")]
    cold = llm.generate(prompts[0], _greedy(8), use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    warm = llm.generate(prompts[1:], _greedy(8), use_tqdm=False)
    n_shared = len(llm.get_tokenizer().encode(SHARED))
    for out in warm:
        assert out.num_cached_tokens >= (n_shared - 4) // 4 * 4 > 8
    again = llm.generate(prompts[0], _greedy(8), use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(cold.prompt_token_ids) - 1) // 4 * 4
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    _expect(hf, llm, prompts, [cold, *warm], 8)
