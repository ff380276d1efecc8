"""Attention over part of a context, and the merge of such parts (context parallel).

When a sequence's keys are spread over ranks (decode context parallel keeps token p on
rank p % n), each rank attends its queries to the keys it holds and returns, beside the
output normalised over those keys, the log-sum-exp of their scores. Outputs of disjoint
key sets merge exactly:

    lse = log(sum_r exp(lse_r)),   out = sum_r exp(lse_r - lse) * out_r

which is softmax attention over the union. A query none of whose keys a rank holds gets
lse -inf and out 0 there, and weight 0 in the merge. Both functions compute in float32.
"""

from __future__ import annotations

import torch


def partial_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of `query` [q, H, D] to `key`/`value` [k, H, D] (KV heads already
    repeated to H), a query at position p seeing the keys at positions <= p.

    Returns (out float32 [q, H, D], lse float32 [q, H]); rows that see no key: 0, -inf.
    """
    scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * scale
    visible = key_positions.view(1, -1) <= query_positions.view(-1, 1)  # [q, k]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, q]
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp(min=torch.finfo(torch.float32).min))
    probs = probs.nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", probs, value.float())
    return out, lse.transpose(0, 1).contiguous()


def merge_attention_states(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Merge partial attentions over disjoint key sets: `outs` [R, q, H, D] and `lses`
    [R, q, H] (float32, as `partial_attention` returns) -> float32 [q, H, D]."""
    total = torch.logsumexp(lses, dim=0)  # [q, H]
    weights = torch.exp(lses - total.clamp(min=torch.finfo(torch.float32).min)).nan_to_num(0.0)
    return (weights.unsqueeze(-1) * outs.float()).sum(dim=0)
