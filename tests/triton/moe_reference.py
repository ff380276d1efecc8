"""A plain-PyTorch mixture-of-experts reference for the fused MoE kernel.

The core has no MoE op yet (the hybrid-models work adds the core's MoE layer and its
reference); until then this is the oracle, written for obviousness: float32 math, one
expert at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_routing(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int64 [T, k], weights float32 [T, k]): softmax, then top-k, best first."""
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def reference_moe(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
) -> torch.Tensor:
    """sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's top-k experts e."""
    ids, weights = reference_routing(router_logits, top_k, renormalize)
    x = hidden.float()
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for expert in range(w1.shape[0]):
        tokens, slot = torch.nonzero(ids == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens] @ w1[expert].float().T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = act @ w2[expert].float().T
        out.index_add_(0, tokens, down * weights[tokens, slot, None])
    return out.to(hidden.dtype)
