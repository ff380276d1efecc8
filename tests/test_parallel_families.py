"""Tensor, expert, pipeline and sequence parallel for the families beyond the llama layer,
over the "mp" executor and gloo: greedy tokens identical to one process (whose own tokens
are checked against transformers' greedy here, for the two families new to TP).

- tp=2 and tp=2 with `enable_expert_parallel`: DeepSeek-V3 (MLA split by heads, its
  latent cache replicated on every rank; dense MLP, shared and routed experts) and
  Qwen3-Next (Gated DeltaNet by key-head groups, each rank's recurrent state holding its
  heads only; gated attention; shared + routed experts). Each rank holds about 1/tp of
  the weights (sharded on load), and the TP group all-reduces exactly (2 L + 1) rows
  of hidden per token: the shared experts' partial sum rides in the routed experts'
  reduction (or, under EP, replaces the MLP's), never an extra one.
- tp=2: Kimi Linear (KDA by heads, MLA as DeepSeek's) and Bamba (Mamba2 heads with
  their B/C groups).
- pp=2: Gemma 3 (scaled embedding, sliding + global layers in different stages),
  gpt-oss (MoE, sinks, sliding + full), Qwen3-MoE (its dense layer on the second stage),
  DeepSeek-V3 (MLA, a dense then MoE layers), the hybrids Kimi Linear (KDA + MLA) and
  Bamba (Mamba2 + attention, its `final_layernorm` on the last stage), and Qwen3-Next
  tp=2 x pp=2 (its first stage holds only Gated DeltaNet layers).
- sequence parallel (tp=2): Gemma 3, Qwen3-MoE (experts' intermediate split: tokens
  gathered into the MoE and its output reduce-scattered), gpt-oss with expert parallel
  (each rank dispatches its own token slice) and DeepSeek-V3 with and without EP (MLA
  gathers the tokens; the shared experts' partial sum is reduce-scattered): no
  all-reduce is left.

Every run uses a 16-token step budget, so the longest prompt prefills in chunks (a
recurrent state carried across chunks and, under pp, across stages).
"""

from __future__ import annotations

import pytest
import torch
from test_deepseek_v3 import save_tiny, tiny_config
from tiny_models import load_hf, make_tiny_model

from tokenmill import LLM, SamplingParams
from tokenmill_conformance.tiny_models import make_tokenizer

pytestmark = pytest.mark.long  # multi-process groups for every family and dimension: minutes

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "def main():\n    return 42\n tokenmill turns any accelerator into tokens",
]
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
ARCHS = ("deepseek_v3", "qwen3_next", "kimi_linear", "bamba", "gemma3", "gpt_oss", "qwen3_moe")
HF_CHECKED = ("deepseek_v3", "qwen3_next")


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, platform="cpu", num_kv_blocks=96,
               max_num_batched_tokens=16, enable_prefix_caching=False, **kw)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _hf_greedy(path, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy continuation, recomputing the whole sequence each token."""
    model = load_hf(path)
    ids, out = torch.tensor([prompt_ids]), []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            out.append(int(model(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (checkpoint dir, one process's greedy tokens, KV block bytes, parameter
    bytes). DeepSeek-V3 is test_deepseek_v3's tiny model (a random correction bias, so
    it moves the routing); the others are tests/tiny_models.py's."""
    out = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(arch)
        if arch == "deepseek_v3":
            tokenizer = make_tokenizer(300)
            save_tiny(path, tiny_config(len(tokenizer)), tokenizer)
        else:
            make_tiny_model(path, arch)
        llm = _llm(path)
        rpc = llm.engine.executor.collective_rpc
        tokens = _tokens(llm)
        if arch in HF_CHECKED:
            tok = llm.get_tokenizer()
            assert tokens == [_hf_greedy(path, tok.encode(p)) for p in PROMPTS], arch
        out[arch] = (path, tokens, rpc("kv_block_bytes")[0], rpc("parameter_bytes")[0])
        llm.engine.shutdown()
    return out


def _all_reduce_bytes_of_a_prompt(llm: LLM, num_tokens: int) -> list[int]:
    rpc = llm.engine.executor.collective_rpc
    before = rpc("communicated_op_bytes", ("tp", "all_reduce"))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate({"prompt_token_ids": list(range(5, 5 + num_tokens))}, one, use_tqdm=False)
    after = rpc("communicated_op_bytes", ("tp", "all_reduce"))
    return [a - b for a, b in zip(after, before, strict=True)]


@pytest.mark.parametrize(
    "arch, ep",
    [("deepseek_v3", False), ("deepseek_v3", True), ("qwen3_next", False), ("qwen3_next", True),
     ("kimi_linear", False), ("bamba", False)],
)
def test_tp2_and_ep2_match_one_process(models, arch, ep):
    path, want, full_block_bytes, full_param_bytes = models[arch]
    tp = 2
    llm = _llm(path, tensor_parallel_size=tp, enable_expert_parallel=ep)
    try:
        assert _tokens(llm) == want
        rpc = llm.engine.executor.collective_rpc
        block_bytes, per_rank = rpc("kv_block_bytes"), rpc("parameter_bytes")
        dispatched = rpc("communicated_op_bytes", ("tp", "all_to_all_single"))
        reduced = _all_reduce_bytes_of_a_prompt(llm, 13)
        hf = llm.engine.loaded.hf_config
    finally:
        llm.engine.shutdown()
    if arch in ("deepseek_v3", "kimi_linear"):
        # the latent cache is replicated: every rank caches each token's whole latent row
        # (and the pages, sized by it, hold this rank's half of a KDA state)
        assert block_bytes == [full_block_bytes] * tp
    else:
        # attention pages and recurrent states hold this rank's heads only
        assert block_bytes == [full_block_bytes // tp] * tp
    assert (min(dispatched) > 0) if ep else dispatched == [0] * tp
    # sharded on load: no rank holds more than its share plus the replicated small parts
    # (norms, routers, MLA's latent projections)
    assert max(per_rank) < full_param_bytes / tp * 1.3, (per_rank, full_param_bytes)
    assert sum(per_rank) >= full_param_bytes
    # one all-reduce per attention / mixer and per MLP or MoE layer, plus the embedding's
    rows = (2 * hf.num_hidden_layers + 1) * 13
    assert reduced == [rows * hf.hidden_size * 4] * tp


@pytest.mark.parametrize(
    "arch, tp",
    [("gemma3", 1), ("gpt_oss", 1), ("qwen3_moe", 1), ("deepseek_v3", 1), ("kimi_linear", 1),
     ("bamba", 1), ("qwen3_next", 2)],
)
def test_pp2_matches_one_process(models, arch, tp):
    path, want, _, full_param_bytes = models[arch]
    llm = _llm(path, pipeline_parallel_size=2, tensor_parallel_size=tp)
    try:
        assert len(llm.engine.executor.pids) == 2 * tp
        assert _tokens(llm) == want
        rpc = llm.engine.executor.collective_rpc
        per_rank = rpc("parameter_bytes")
        assert min(rpc("communicated_bytes", ("pp",))) > 0  # activations crossed stages
    finally:
        llm.engine.shutdown()
    # each stage loads its own layers only (the tied embedding may sit on both ends)
    assert max(per_rank) < full_param_bytes * (0.8 if tp == 1 else 0.5), (per_rank, full_param_bytes)


@pytest.mark.parametrize(
    "arch, ep",
    [("gemma3", False), ("qwen3_moe", False), ("gpt_oss", True), ("deepseek_v3", False),
     ("deepseek_v3", True)],
)
def test_sequence_parallel_matches_one_process(models, arch, ep):
    path, want, _, _ = models[arch]
    llm = _llm(path, tensor_parallel_size=2, enable_sequence_parallelism=True,
               enable_expert_parallel=ep)
    try:
        assert _tokens(llm) == want
        reduced = _all_reduce_bytes_of_a_prompt(llm, 13)
        scattered = llm.engine.executor.collective_rpc(
            "communicated_op_bytes", ("tp", "reduce_scatter"))
    finally:
        llm.engine.shutdown()
    assert reduced == [0, 0]  # every all-reduce became a reduce-scatter (or EP's all-to-all)
    assert min(scattered) > 0


def test_bad_sizes_and_unsplit_families_are_named():
    from transformers import KimiLinearConfig, Qwen3NextConfig

    from tokenmill.model.registry import check_sequence_parallel, family_for

    def local_config(config, tp):
        return family_for(config).local_config(config, tp)

    next_config = Qwen3NextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, num_experts=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, intermediate_size=128,
    )
    with pytest.raises(ValueError, match="does not divide the model's Gated DeltaNet key heads 2"):
        local_config(next_config, 4)
    local = local_config(next_config, 2)
    assert (local.linear_num_key_heads, local.linear_num_value_heads) == (1, 2)
    assert local.shared_expert_intermediate_size == 24
    kimi = KimiLinearConfig(linear_attn_config={"head_dim": 16, "num_heads": 3})
    with pytest.raises(ValueError, match="does not divide the model's KDA heads 3"):
        local_config(kimi, 2)
    with pytest.raises(ValueError, match="enable_sequence_parallelism supports model types"):
        check_sequence_parallel(next_config)
