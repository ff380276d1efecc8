"""Every family's complete state crosses: a prefill engine and a decode engine in this
process, each with its own KV arena registered with a real transport (NIXL over UCX/TCP
on loopback, Mooncake's transfer engine for two families), hand a batch over; greedy
output equals a colocated engine's. A second round of the same prompts pulls only what
the decode engine's prefix cache lacks (the partial last blocks, the recurrent states,
the sliding window's blocks past its cache) and stays identical.

Families and what they carry: llama (full attention), gemma3 (sliding window + full),
gpt_oss (sliding + full, MoE), qwen3_next (Gated DeltaNet state + full), bamba (Mamba2
conv + SSM state + full), kimi_linear (KDA state + MLA latents), deepseek_v3 (MLA)."""

from __future__ import annotations

import time

import pytest
from transformers import AutoConfig

from tokenmill import LLM, SamplingParams
from tokenmill.kv_connector.handover.messages import HandoverIn
from tokenmill_conformance.tiny_models import make_tiny_model

pytestmark = pytest.mark.long  # engine pairs or server processes for prefill and decode: minutes

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 250 + 5 for j in range(n)] for i, n in enumerate([13, 21, 8])]
KW = dict(dtype="float32", block_size=BS, max_num_batched_tokens=32, num_kv_blocks=256)


def _run(engine, timeout_s: float = 120.0) -> dict:
    outs, deadline = {}, time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        assert time.monotonic() < deadline, "the engine did not finish"
    return outs


def _handover(prefill, decode, tag: str) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        prefill.add_request(f"p{tag}{i}", p, GREEDY, handover_out=True)
    offers = _run(prefill)
    endpoint = prefill.handover.endpoint()
    for i, p in enumerate(PROMPTS):
        offer = offers[f"p{tag}{i}"].kv_offer
        assert offer is not None and offer.num_tokens == len(p)
        decode.add_request(f"d{tag}{i}", p, GREEDY, handover_in=HandoverIn(offer, endpoint))
    outs = _run(decode)
    assert all(outs[f"d{tag}{i}"].kv_pulled for i in range(len(PROMPTS)))
    prefill.release_handover([f"p{tag}{i}" for i in range(len(PROMPTS))])
    assert prefill.handover.stats().leases_held == 0
    return [list(outs[f"d{tag}{i}"].outputs[0].token_ids) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("arch,transport", [
    ("llama", "mooncake"), ("gemma3", "mooncake"), ("gpt_oss", "mooncake"),
    ("qwen3_next", "mooncake"), ("bamba", "mooncake"), ("kimi_linear", "mooncake"),
    ("deepseek_v3", "mooncake"),
])
def test_greedy_identical_to_colocated(arch, transport, tmp_path):
    path = str(make_tiny_model(tmp_path / arch, arch))
    colocated = LLM(path, **KW)
    reference = [list(o.outputs[0].token_ids) for o in colocated.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    colocated.engine.shutdown()
    prefill = LLM(path, kv_role="prefill", kv_transport=transport, **KW).engine
    decode = LLM(path, kv_role="decode", kv_transport=transport, **KW).engine
    try:
        assert _handover(prefill, decode, "a") == reference
        first = decode.handover.stats()
        assert first.received == 3 and first.failed == 0 and first.blocks_skipped == 0
        assert first.transport_bytes == first.bytes_moved > 0
        # again: the decode engine's prefix cache holds the prompts' full blocks
        assert _handover(prefill, decode, "b") == reference
        second = decode.handover.stats()
        full_blocks = sum(len(p) // BS for p in PROMPTS)
        assert second.blocks_skipped - first.blocks_skipped >= full_blocks
        assert second.blocks_pulled - first.blocks_pulled < first.blocks_pulled
        assert second.transport_bytes == second.bytes_moved
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_tensor_parallel_two_to_two_hybrid(tmp_path):
    """tp 2 on both sides (worker processes): rank r pulls rank r's shard of every block
    and of every recurrent state; the ranks agree through the TP group on when a pull
    ended. Between different tp sizes: test_tensor_parallel_resharded below."""
    path = str(make_tiny_model(tmp_path / "qwen3_next", "qwen3_next"))
    colocated = LLM(path, **KW)
    reference = [list(o.outputs[0].token_ids) for o in colocated.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    colocated.engine.shutdown()
    tp = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
    prefill = LLM(path, kv_role="prefill", kv_transport="mooncake", **KW, **tp).engine
    decode = LLM(path, kv_role="decode", kv_transport="mooncake", **KW, **tp).engine
    try:
        assert len(prefill.handover.endpoint().ranks) == 2
        assert _handover(prefill, decode, "a") == reference
        stats = decode.handover.stats()
        assert stats.received == 3 and stats.transport_bytes == stats.bytes_moved > 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def _whole_bytes(config) -> tuple[int, int]:
    """(bytes of one KV block over every attention layer and KV head, bytes of one
    request's recurrent states over every linear layer), float32, from the model's config
    alone: each byte once, whatever the tp sizes (an MLA page, whole on every decode
    rank, is read by rank 0 and broadcast to the others over the TP group)."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    if getattr(config, "kv_lora_rank", None):  # MLA: one latent row per token and layer
        row = config.kv_lora_rank + config.qk_rope_head_dim
        block = kinds.count("full_attention") * BS * row * 4
    else:
        head_size = (getattr(config, "head_dim", None)
                     or config.hidden_size // config.num_attention_heads)
        block = kinds.count("full_attention") * 2 * BS * config.num_key_value_heads * head_size * 4
    if "linear_attention" not in kinds:
        return block, 0
    if hasattr(config, "mamba_n_heads"):  # Mamba2: conv over x, B, C; SSM [H, P, N]
        inner = config.mamba_n_heads * config.mamba_d_head
        bc = config.mamba_n_groups * config.mamba_d_state
        conv = (inner + 2 * bc) * (config.mamba_d_conv - 1) * 4
        ssm = inner * config.mamba_d_state * 4
    elif hasattr(config, "linear_num_heads"):  # KDA: conv over q, k, v; state [H, d, d]
        size = config.linear_num_heads * config.linear_head_dim
        conv = 3 * size * (config.linear_conv_kernel_dim - 1) * 4
        ssm = size * config.linear_head_dim * 4
    else:  # Gated DeltaNet: conv over q, k, v; state [Hv, dk, dv]
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        conv = (2 * key_dim + value_dim) * (config.linear_conv_kernel_dim - 1) * 4
        ssm = value_dim * config.linear_key_head_dim * 4
    return block, kinds.count("linear_attention") * (conv + ssm)


@pytest.mark.parametrize("arch,prefill_tp,decode_tp", [
    ("llama", 2, 1), ("llama", 1, 2), ("qwen3_next", 2, 1), ("qwen3_next", 1, 2),
    ("deepseek_v3", 2, 1), ("deepseek_v3", 1, 2), ("bamba", 2, 1), ("kimi_linear", 1, 2),
])
def test_tensor_parallel_resharded(arch, prefill_tp, decode_tp, tmp_path):
    """A prefill engine of one tp size hands over to a decode engine of another (llama:
    2 KV heads, one per rank at tp 2; qwen3_next: its Gated DeltaNet states' conv channels
    and value heads split too; deepseek_v3: MLA latents, the same on every rank, read from
    one; bamba: Mamba2 states, the conv's x, B, C channels and the SSM heads split, one
    B/C group per rank; kimi_linear: KDA states, q, k, v conv channels and heads, with MLA
    latents): each decode rank reads its heads and state rows from the peer ranks that hold
    them, into place. Greedy output equals a colocated tp 1 engine's,
    and the transports move each missing block's bytes once and each recurrent state's
    rows once, whatever the sizes: the pulled blocks times one block over every attention
    layer and KV head, plus one whole state per linear layer and request (MLA pages once:
    decode rank 0 reads them and broadcasts them to the others)."""
    path = str(make_tiny_model(tmp_path / arch, arch))
    colocated = LLM(path, **KW)
    reference = [list(o.outputs[0].token_ids) for o in colocated.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    colocated.engine.shutdown()
    block_bytes, state_bytes = _whole_bytes(AutoConfig.from_pretrained(path))

    def tp(n: int) -> dict:
        return dict(tensor_parallel_size=n, distributed_executor_backend="mp") if n > 1 else {}

    prefill = LLM(path, kv_role="prefill", kv_transport="mooncake", **KW, **tp(prefill_tp)).engine
    decode = LLM(path, kv_role="decode", kv_transport="mooncake", **KW, **tp(decode_tp)).engine
    try:
        assert len(prefill.handover.endpoint().ranks) == prefill_tp
        assert _handover(prefill, decode, "a") == reference
        stats = decode.handover.stats()
        assert stats.received == 3 and stats.failed == 0 and stats.blocks_skipped == 0
        num_blocks = sum(-(-len(p) // BS) for p in PROMPTS)
        expected = num_blocks * block_bytes + len(PROMPTS) * state_bytes
        assert stats.transport_bytes == stats.bytes_moved == expected
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_fp8_kv_hands_over_its_fp8_pages(arch, tmp_path):
    """Both engines store KV in FP8 (full attention; MLA latents): the decode engine pulls
    the FP8 pages as they are, greedy output equals a colocated FP8 engine's, and the bytes
    moved are a quarter of a float32-KV pair's for the same prompts."""
    path = str(make_tiny_model(tmp_path / arch, arch))
    moved = {}
    for kv_dtype in ("fp8", None):
        kw = KW | ({"kv_cache_dtype": kv_dtype} if kv_dtype else {})
        colocated = LLM(path, **kw)
        reference = [list(o.outputs[0].token_ids) for o in colocated.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
        colocated.engine.shutdown()
        prefill = LLM(path, kv_role="prefill", kv_transport="mooncake", **kw).engine
        decode = LLM(path, kv_role="decode", kv_transport="mooncake", **kw).engine
        try:
            assert _handover(prefill, decode, "a") == reference, kv_dtype
            stats = decode.handover.stats()
            assert stats.received == 3 and stats.failed == 0
            assert stats.transport_bytes == stats.bytes_moved > 0
            moved[kv_dtype] = stats.bytes_moved
        finally:
            prefill.shutdown()
            decode.shutdown()
    assert moved["fp8"] * 4 == moved[None], moved
