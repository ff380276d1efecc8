"""The core's MoE: routing and the reference `moe_experts` op against transformers' blocks.

gpt-oss's (top-k then softmax, biased experts, clamped SwiGLU) runs end to end in
test_hybrid_models.py; here Qwen3-MoE's block (softmax then top-k, optionally
renormalised, silu experts) checks the other routing and activation.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tokenmill.model.linear import LayerBuilder
from tokenmill.model.moe import FusedMoE, deinterleave_gate_up, select_experts
from tokenmill.platforms.ops import resolve_ops
from tokenmill.platforms.ops.reference import moe_experts


@pytest.mark.parametrize("renormalize", [False, True])
def test_qwen3_moe_block_matches_transformers(renormalize):
    config = Qwen3MoeConfig(
        hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=renormalize,
    )
    torch.manual_seed(0)
    hf = Qwen3MoeSparseMoeBlock(config).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = FusedMoE(
        hidden_size=32, intermediate_size=16, num_experts=6, top_k=2, routing="softmax_topk",
        renormalize=renormalize, activation="silu", router_bias=False, expert_bias=False,
        build=LayerBuilder(ops=resolve_ops(), dtype=torch.float32), prefix="mlp",
    )
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.w13.copy_(hf.experts.gate_up_proj)  # transformers 5 stacks experts as we do
        ours.w2.copy_(hf.experts.down_proj)
    x = torch.randn(1, 23, 32)
    with torch.no_grad():
        want = hf(x)[0]
        got = ours(x[0])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_every_expert_and_repeated_tokens():
    """Each token's k experts are summed with its weights, whichever experts are hit."""
    g = torch.Generator().manual_seed(1)
    t, h, i, e, k = 9, 8, 4, 5, 3
    x = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    b13, b2 = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    got = moe_experts(x, w13, w2, weights, ids, b13, b2, activation="silu")
    want = torch.zeros(t, h)
    for r in range(t):
        for j in range(k):
            ex = ids[r, j]
            gate, up = (w13[ex] @ x[r] + b13[ex]).chunk(2)
            want[r] += weights[r, j] * (w2[ex] @ (torch.nn.functional.silu(gate) * up) + b2[ex])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_routing_orders_and_errors():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = select_experts(logits, 2, "topk_softmax")
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, torch.tensor([[3.0, 2.0]]).softmax(-1))
    w, ids = select_experts(logits, 2, "softmax_topk")
    torch.testing.assert_close(w, logits.softmax(-1)[:, [1, 2]])
    w, _ = select_experts(logits, 2, "softmax_topk", renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(1))
    with pytest.raises(ValueError, match="'sigmoid'"):
        select_experts(logits, 2, "sigmoid")
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="'gelu'"):
        moe_experts(x, torch.zeros(2, 4, 4), torch.zeros(2, 4, 2), w, ids, activation="gelu")
    with pytest.raises(ValueError, match="expert 3"):
        moe_experts(x, torch.zeros(2, 4, 4), torch.zeros(2, 4, 2), w, torch.tensor([[0, 3]]))


def test_deinterleave_gate_up():
    t = torch.tensor([[0, 10, 1, 11, 2, 12]])
    assert deinterleave_gate_up(t, dim=1).tolist() == [[0, 1, 2, 10, 11, 12]]
    assert deinterleave_gate_up(t.T, dim=0).T.tolist() == [[0, 1, 2, 10, 11, 12]]
