"""Context parallel over the "mp" executor with gloo, greedy tokens identical to one
process.

Decode context parallel: the log-sum-exp merge of interleaved partial attentions equals
the core's reference attention, and a sequence's KV spread over 2 ranks (alone, and
beside tp=2: 4 ranks) gives one process's tokens, each rank's KV blocks holding half the
tokens. Prefill context parallel: a step's tokens split over 2 ranks (alone, beside
tp=2, and on Gemma 3's sliding windows with chunked prefill mixing prompts and decodes);
the counted all-gathers show the split ran."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.platforms.interfaces import AttentionKind, AttentionMetadata, AttentionSpec
from tokenmill.platforms.ops.attention_merge import merge_attention_states, partial_attention
from tokenmill.platforms.ops.reference import paged_attention

PROMPTS = ["The quick brown fox", "Paris is the capital of France; Berlin is", "def main():"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("num_parts", [2, 3])
def test_merged_interleaved_parts_equal_reference_attention(num_parts):
    """Two sequences, a whole prefill of 13 and a chunk of 5 ending at 11 (GQA 4:2); the
    keys dealt to `num_parts` ranks by position (p % n), each part attended separately
    (position 0's query sees nothing on every rank but rank 0), then merged."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    spec = AttentionSpec(kind=AttentionKind.FULL, num_heads=heads, num_kv_heads=kv_heads,
                         head_size=dim, dtype=torch.float32, block_size=block)
    query_lens, seq_lens = [13, 5], [13, 11]
    tables = [[0, 1, 2, 3], [4, 5, 6]]
    keys = [torch.randn(n, kv_heads, dim, generator=gen) for n in seq_lens]
    values = [torch.randn(n, kv_heads, dim, generator=gen) for n in seq_lens]
    query = torch.randn(sum(query_lens), heads, dim, generator=gen)
    # reference: the earlier keys of the chunked sequence already cached, then the step
    cache = torch.zeros(2, 8, block, kv_heads, dim)
    prefix = AttentionMetadata.build([6], [6], [tables[1]], block)
    paged_attention(spec, torch.zeros(6, heads, dim), keys[1][:6], values[1][:6], cache, prefix)
    step = AttentionMetadata.build(query_lens, seq_lens, tables, block)
    step_keys = torch.cat([keys[0], keys[1][6:]])
    step_values = torch.cat([values[0], values[1][6:]])
    want = paged_attention(spec, query, step_keys, step_values, cache, step)

    got, start = [], 0
    for q_len, n, k, v in zip(query_lens, seq_lens, keys, values):
        q = query[start : start + q_len]
        q_pos = torch.arange(n - q_len, n)
        outs, lses = [], []
        for rank in range(num_parts):
            k_pos = torch.arange(rank, n, num_parts)
            out, lse = partial_attention(
                q, k[k_pos].repeat_interleave(2, 1), v[k_pos].repeat_interleave(2, 1), q_pos,
                k_pos, dim**-0.5,
            )
            outs.append(out)
            lses.append(lse)
        assert torch.isinf(lses[1][0]).all() if q_len == n else True  # nothing seen
        got.append(merge_attention_states(torch.stack(outs), torch.stack(lses)))
        start += q_len
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-5)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, platform="cpu", num_kv_blocks=64, **kw)


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    llm = _llm(tiny_dirs["llama"])
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    block_bytes = llm.engine.executor.collective_rpc("kv_block_bytes")[0]
    llm.engine.shutdown()
    return tokens, block_bytes


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.long)])
def test_dcp2_matches_one_process(tiny_dirs, reference, tp):
    want, full_block_bytes = reference
    llm = _llm(tiny_dirs["llama"], decode_context_parallel_size=2, tensor_parallel_size=tp)
    try:
        assert len(llm.engine.executor.pids) == 2 * tp
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        rpc = llm.engine.executor.collective_rpc
        block_bytes = rpc("kv_block_bytes")
        merged = rpc("communicated_op_bytes", ("dcp", "all_gather"))
    finally:
        llm.engine.shutdown()
    assert got == want
    # a block of 4 tokens holds 2 on each dcp rank (and, with tp=2, its one KV head)
    assert block_bytes == [full_block_bytes // (2 * tp)] * (2 * tp)
    assert all(b > 0 for b in merged)


def test_bad_decode_context_parallel_settings_are_named(tiny_dirs, tmp_path):
    from tiny_models import make_tiny_model

    with pytest.raises(ValueError, match="decode_context_parallel_size=3 must divide block_size=4"):
        _llm(tiny_dirs["llama"], decode_context_parallel_size=3)
    gemma = make_tiny_model(tmp_path / "gemma3", "gemma3")  # a sliding-window layer
    with pytest.raises(ValueError, match=r"full attention layers without sinks; layers \[0\]"):
        _llm(gemma, decode_context_parallel_size=2)


@pytest.mark.parametrize("arch, kw", [
    pytest.param("llama", {}, marks=pytest.mark.long),
    pytest.param("llama", {"tensor_parallel_size": 2}, marks=pytest.mark.long),
    ("gemma3", {"max_num_batched_tokens": 9}),  # chunks of prompts beside decodes
])
def test_pcp2_matches_one_process(tiny_dirs, tmp_path, arch, kw):
    from tiny_models import make_tiny_model

    path = tiny_dirs[arch] if arch in tiny_dirs else make_tiny_model(tmp_path / arch, arch)
    llm = _llm(path)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm.engine.shutdown()
    llm = _llm(path, prefill_context_parallel_size=2, **kw)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        gathered = llm.engine.executor.collective_rpc("communicated_op_bytes", ("pcp", "all_gather"))
    finally:
        llm.engine.shutdown()
    assert got == want
    assert all(b > 0 for b in gathered)
