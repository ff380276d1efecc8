"""Mixture-of-experts: top-k routing with the model's normalisation, then the expert GEMMs.

Routing is here, in plain torch (a [T, E] matmul and a top-k are cheap); the expert
GEMMs are the op `moe_experts` (reference: `tokenmill.ops.reference.moe_experts`), which a
platform overrides with a fused kernel. The weights of every expert are stacked in one
tensor per projection, in the op's layout: `w13` [E, 2I, H] (each expert's gate rows,
then its up rows) and `w2` [E, H, I]. Checkpoints that store experts otherwise (gpt-oss:
transposed and gate/up interleaved; Qwen/Mixtral: one tensor per expert) are converted
once at load by the model family's weight mapping.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.layers import Linear
from tokenmill.ops import Ops

# How a family turns router logits into top-k weights:
# - "softmax_topk": softmax over all experts, keep the top k (Mixtral, Qwen); with
#   `renormalize` the kept weights are divided by their sum (Qwen's norm_topk_prob).
# - "topk_softmax": keep the top-k logits, softmax over those k only (gpt-oss).
ROUTING = ("softmax_topk", "topk_softmax")


def select_experts(
    router_logits: torch.Tensor, top_k: int, routing: str, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [T, k], int64 expert ids [T, k]) from router logits [T, E].

    Ties between equal logits go to the lower expert id (torch.topk's order), as in
    transformers.
    """
    if routing == "topk_softmax":
        values, ids = torch.topk(router_logits, top_k, dim=-1)
        return values.float().softmax(dim=-1), ids
    if routing == "softmax_topk":
        probs = router_logits.float().softmax(dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    raise ValueError(f"routing {routing!r} is not one of {ROUTING}")


class FusedMoE(nn.Module):
    """A router (Linear hidden -> E) and E experts, each a gated MLP hidden -> I -> hidden.

    `forward(x)`: x [T, hidden] -> [T, hidden]. Parameters: `router.weight` [E, H]
    (+ `router.bias` [E]), `w13` [E, 2I, H], `w2` [E, H, I] (+ `w13_bias`, `w2_bias`).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        routing: str,
        renormalize: bool,
        activation: str,
        router_bias: bool,
        expert_bias: bool,
        ops: Ops,
        dtype: torch.dtype,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
    ) -> None:
        super().__init__()
        if routing not in ROUTING:
            raise ValueError(f"routing {routing!r} is not one of {ROUTING}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.routing, self.renormalize, self.activation = routing, renormalize, activation
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.router = Linear(hidden_size, num_experts, router_bias, dtype)
        e, h, i = num_experts, hidden_size, intermediate_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype))
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype)) if expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(e, h, dtype=dtype)) if expert_bias else None
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.router(x), self.top_k, self.routing, self.renormalize)
        return self.ops.moe_experts(
            x,
            self.w13,
            self.w2,
            weights,
            ids,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
            activation=self.activation,
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
        )


def deinterleave_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gate/up alternating along `dim` (g0 u0 g1 u1 ...) -> all gates, then all ups."""
    dim = dim % t.dim()
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)
