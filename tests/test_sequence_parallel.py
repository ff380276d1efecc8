"""Sequence parallel (enable_sequence_parallelism) over tp=2 with gloo: greedy tokens
identical to one process, and the bytes through the TP communicator equal to the
formula: per step of T tokens (padded to T' = t ceil(T / t)), one reduce-scatter of
T' x hidden for the embedding and each row-parallel layer (2 per decoder layer), one
all-gather of T' x hidden before each column-parallel layer (2 per decoder layer) and of
the final hidden states, and the vocab-parallel logits' all-gather per sampled row."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Paris is the capital of France; Berlin is", "def main():"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, platform="cpu", num_kv_blocks=64,
               enable_prefix_caching=False, **kw)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_sp_matches_one_process_and_counts_the_formula(tiny_dirs):
    path = tiny_dirs["llama"]
    llm = _llm(path)
    want = _tokens(llm)
    llm.engine.shutdown()
    tp = 2
    llm = _llm(path, tensor_parallel_size=tp, enable_sequence_parallelism=True)
    try:
        assert _tokens(llm) == want
        rpc = llm.engine.executor.collective_rpc

        def counted(op: str) -> int:
            per_rank = rpc("communicated_op_bytes", ("tp", op))
            assert len(set(per_rank)) == 1, per_rank  # every rank in every call
            return per_rank[0]

        before = {op: counted(op) for op in ("reduce_scatter", "all_gather", "all_reduce")}
        prompt = list(range(5, 18))  # 13 tokens: padded to 14 over 2 ranks
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate({"prompt_token_ids": prompt}, one, use_tqdm=False)
        after = {op: counted(op) - before[op] for op in before}
        hf = llm.engine.loaded.hf_config
    finally:
        llm.engine.shutdown()
    padded, layers, row = 14, hf.num_hidden_layers, hf.hidden_size * 4
    assert after["all_reduce"] == 0  # sequence parallel replaces every all-reduce
    assert after["reduce_scatter"] == (2 * layers + 1) * padded * row
    logits = tp * -(-hf.vocab_size // tp) * 4
    assert after["all_gather"] == (2 * layers + 1) * padded * row + logits


def test_sp_refuses_other_model_types(tmp_path):
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "qwen3_next", "qwen3_next")
    with pytest.raises(ValueError, match="enable_sequence_parallelism supports model types"):
        _llm(path, tensor_parallel_size=2, enable_sequence_parallelism=True)
