"""The performance model's atoms against values computed by hand: each expected figure is
written out from the op's definition (loops over query-key pairs, the shapes of the
matrices multiplied), not from the model's own formulas."""

from __future__ import annotations

import pytest

from tokenmill.planner import ops
from tokenmill.planner.ops import Seq


def pairs_by_loop(cached: int, new: int, window: int = 0) -> int:
    """Visible (query, key) pairs, counted one by one."""
    total = 0
    for q in range(cached, cached + new):
        for k in range(q + 1):
            if not window or q - k < window:
                total += 1
    return total


@pytest.mark.parametrize("cached,new,window", [
    (0, 7, 0), (5, 1, 0), (3, 9, 0), (0, 10, 4), (6, 5, 4), (20, 1, 8), (2, 3, 8)])
def test_visible_keys_counts_every_causal_pair(cached, new, window):
    assert ops.visible_keys(Seq(cached, new), window) == pairs_by_loop(cached, new, window)


def test_gemm():
    # [3 x 64] @ [64 x 32] in bf16 weights and activations
    c = ops.gemm(3, 64, 32, 2, 2)
    assert c.flops == 2 * 3 * 64 * 32  # a multiply and an add per (row, k, n)
    assert c.bytes == 64 * 32 * 2 + 3 * 64 * 2 + 3 * 32 * 2  # weight, input rows, output rows


def test_full_attention_prefill_and_decode():
    # 4 query heads, 2 KV heads of 16, one prompt of 6 tokens and 3 decodes at context 10
    seqs = [Seq(0, 6), Seq(10, 1, count=3)]
    c = ops.attention(seqs, heads=4, kv_heads=2, qk_dim=16, v_dim=16, kv_bytes=2, act_bytes=2)
    pairs = 21 + 3 * 11  # 1+2+...+6, and each decode sees its 10 cached keys and itself
    assert c.op == "attention_full"
    assert c.flops == pairs * 4 * (2 * 16 + 2 * 16)  # q.k and p.v per pair and head
    kv_row = 2 * 16 * 2 + 2 * 16 * 2  # 2 heads of keys and of values, bf16
    read = 6 + 3 * 11  # every visible key once
    written = 6 + 3  # the new tokens' keys and values
    q_and_out = (6 + 3) * 4 * (16 + 16) * 2
    assert c.bytes == (read + written) * kv_row + q_and_out


def test_sliding_attention_reads_only_the_window():
    c = ops.attention([Seq(100, 1)], 2, 1, 8, 8, 2, 2, window=16)
    assert c.op == "attention_sliding"
    assert c.flops == 16 * 2 * (2 * 8 + 2 * 8)  # 16 visible keys
    assert c.bytes == (16 + 1) * (8 + 8) * 2 + 1 * 2 * 16 * 2


def test_mla_absorbed_decode_and_decompressed_prefill():
    # 8 heads, nope 16, rope 8, v 16, latent rank 32 (DeepSeek's shape, small)
    h, nope, rope, v, rank = 8, 16, 8, 16, 32
    dec = ops.mla_attention([Seq(9, 1)], h, nope, rope, v, rank, 2, 2)
    # absorbed: scores over (latent | rope) rows, then the weighted latents: 10 keys
    assert dec.flops == 10 * h * (2 * (rank + rope) + 2 * rank)
    assert dec.bytes == (10 + 1) * (rank + rope) * 2 + 1 * h * (nope + rope + v) * 2
    pre = ops.mla_attention([Seq(0, 4)], h, nope, rope, v, rank, 2, 2)
    # decompressed: ordinary attention with qk = nope + rope and v: 10 pairs
    assert pre.flops == 10 * h * (2 * (nope + rope) + 2 * v)
    up_pre = ops.latent_up([Seq(0, 4)], rank, h * (nope + v), 2, 2)
    up_dec = ops.latent_up([Seq(9, 1)], rank, h * (nope + v), 2, 2)
    assert up_pre.flops == 2 * 4 * rank * h * (nope + v)  # every latent row up-projected
    assert up_dec.flops == 2 * 1 * rank * h * (nope + v)  # q and output absorbed, one row


@pytest.mark.parametrize("variant", ["gated_delta", "kda", "mamba2"])
def test_recurrent_decode_step_and_chunked_prefill(variant):
    heads, dk, dv = 4, 16, 8
    dec = ops.recurrent([Seq(50, 1, count=2)], heads, dk, dv, 2, variant)
    # per token and head: decay (1), k^T S (2), delta update (2), q^T S (2), gate (1)
    assert dec.flops == 2 * heads * dk * dv * (1 + 2 + 2 + 2 + 1)
    state = heads * dk * dv * 4  # float32
    assert dec.bytes == 2 * (2 * state) + 2 * heads * (2 * dk + 3 * dv) * 2
    pre = ops.recurrent([Seq(0, 128)], heads, dk, dv, 2, variant)
    chunk = 64
    per_token = 2 * chunk * dk + 2 * chunk * dk + 2 * chunk * dv + 6 * dk * dv
    assert pre.flops == 128 * heads * per_token
    assert pre.op == f"recurrent_{variant}"


def test_moe_experts_flops_and_touched_weights():
    # 10 tokens, top 2 of 4 experts, hidden 8, intermediate 6, all experts local
    up, down = ops.experts(20, 10, 4, 4, 2, 8, 6, 2, 2)
    assert up.flops == 2 * 20 * 8 * (2 * 6)  # gate and up: [20 x 8] @ [8 x 12]
    assert down.flops == 2 * 20 * 6 * 8
    touched = 4 * (1 - (1 - 2 / 4) ** 10)  # experts hit by at least one of 10 tokens
    assert up.bytes == pytest.approx(touched * 8 * 12 * 2 + 20 * (8 + 12) * 2)
    assert down.bytes == pytest.approx(touched * 6 * 8 * 2 + 20 * (6 + 8) * 2)
    assert (up.inner, up.outer, down.inner, down.outer) == (8, 12, 6, 8)


def test_norms_activation_conv_embedding():
    assert ops.rms_norm(5, 64, 2).flops == 5 * 64 * 4
    assert ops.rms_norm(5, 64, 2).bytes == 2 * 5 * 64 * 2
    assert ops.gated_activation(5, 32, 2).bytes == 3 * 5 * 32 * 2
    conv = ops.short_conv([Seq(0, 6), Seq(30, 1, 3)], channels=12, kernel=4, act_bytes=2)
    assert conv.flops == 2 * 4 * 12 * (6 + 3)
    assert conv.bytes == 2 * 9 * 12 * 2 + 2 * 4 * 12 * 3 * 2  # rows in and out, 4 states of K-1
    assert ops.embedding(7, 16, 2).flops == 0 and ops.embedding(7, 16, 2).bytes == 2 * 7 * 16 * 2
