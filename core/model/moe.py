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
import torch.nn.functional as F
from torch import nn

from tokenmill.model.layers import Linear
from tokenmill.ops import Ops

# How a family turns router logits into top-k weights:
# - "softmax_topk": softmax over all experts, keep the top k (Mixtral, Qwen); with
#   `renormalize` the kept weights are divided by their sum (Qwen's norm_topk_prob).
# - "topk_softmax": keep the top-k logits, softmax over those k only (gpt-oss).
# - "sigmoid_group_topk": DeepSeek-V3 / Kimi: sigmoid scores; experts are chosen on the
#   scores plus a per-expert correction bias, first the `topk_group` best of `num_groups`
#   groups (a group's score: the sum of its best two), then the top k inside them; the
#   weights are the chosen experts' plain sigmoid scores, divided by their sum with
#   `renormalize`, times `routed_scaling_factor`.
ROUTING = ("softmax_topk", "topk_softmax", "sigmoid_group_topk")


def grouped_sigmoid_topk(
    router_logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor | None,
    num_groups: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing ("sigmoid_group_topk"), in float32, as transformers'
    DeepseekV3TopkRouter computes it."""
    num_experts = router_logits.shape[-1]
    if num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not split into {num_groups} groups")
    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    grouped = choice.view(-1, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    group_ids = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1).bool()
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, num_experts)
    choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    routing: str,
    renormalize: bool = False,
    *,
    correction_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [T, k], int64 expert ids [T, k]) from router logits [T, E].

    The keyword arguments are "sigmoid_group_topk"'s (see ROUTING). Ties between equal
    logits go to the lower expert id (torch.topk's order), as in transformers.
    """
    if routing == "sigmoid_group_topk":
        return grouped_sigmoid_topk(
            router_logits, top_k, correction_bias, num_groups, topk_group, renormalize,
            routed_scaling_factor,
        )
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
    With "sigmoid_group_topk" routing the router runs in float32 and the layer has
    `e_score_correction_bias` (float32 [E]). `shared_experts` (DeepSeek, Kimi, Qwen MoE):
    a module every token goes through beside its routed experts; its output is added.
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
        num_groups: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        shared_experts: nn.Module | None = None,
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
        self.e_score_correction_bias = None
        if routing == "sigmoid_group_topk":
            # float32 as in the checkpoint: a rounded bias could change which experts win
            self.e_score_correction_bias = nn.Parameter(torch.empty(e, dtype=torch.float32))
        self.num_groups, self.topk_group = num_groups, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.shared_experts = shared_experts
        self.ops = ops

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.routing == "sigmoid_group_topk":  # DeepSeek routes in float32
            bias = None if self.router.bias is None else self.router.bias.float()
            return F.linear(x.float(), self.router.weight.float(), bias)
        return self.router(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(
            self.router_logits(x), self.top_k, self.routing, self.renormalize,
            correction_bias=self.e_score_correction_bias, num_groups=self.num_groups,
            topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
        )
        routed = self.ops.moe_experts(
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
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return routed


def deinterleave_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gate/up alternating along `dim` (g0 u0 g1 u1 ...) -> all gates, then all ups."""
    dim = dim % t.dim()
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)


class ExpertStacker:
    """Stacks a checkpoint's per-expert MLP tensors (`<prefix>.experts.<e>.gate_proj.weight`,
    `up_proj`, `down_proj`, as DeepSeek, Kimi, Qwen and Mixtral checkpoints store them)
    into the op's `w13` [E, 2I, H] and `w2` [E, H, I], as the tensors stream in.

    `add(hf_name, tensor)` returns None when the name is not a per-expert tensor; else a
    list of (our parameter name, stacked tensor), empty until every expert of that
    projection of the layer has arrived. Holds at most one layer's experts at a time in
    a checkpoint stored layer by layer.
    """

    _LEAVES = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        # (layer prefix, our parameter) -> {(expert, part): tensor}
        self.pending: dict[tuple[str, str], dict[tuple[int, int], torch.Tensor]] = {}

    def add(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        parts = hf_name.split(".")
        if len(parts) < 5 or parts[-4] != "experts" or parts[-1] != "weight":
            return None
        if parts[-2] not in self._LEAVES or not parts[-3].isdigit():
            return None
        prefix, expert = ".".join(parts[:-4]), int(parts[-3])
        if not 0 <= expert < self.num_experts:
            raise KeyError(f"checkpoint weight {hf_name!r}: expert {expert} of {self.num_experts}")
        param, part = self._LEAVES[parts[-2]]
        got = self.pending.setdefault((prefix, param), {})
        got[(expert, part)] = tensor
        num_parts = 2 if param == "w13" else 1
        if len(got) < self.num_experts * num_parts:
            return []
        del self.pending[(prefix, param)]
        stacked = torch.stack([
            torch.cat([got[(e, p)] for p in range(num_parts)], dim=0)
            for e in range(self.num_experts)
        ])
        return [(f"{prefix}.{param}", stacked)]
