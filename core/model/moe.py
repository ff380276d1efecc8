"""Mixture-of-experts: top-k routing with the model's normalisation, then the expert GEMMs.

Routing is here, in plain torch (a [T, E] matmul and a top-k are cheap); the expert
GEMMs are the op `moe_experts` (reference: `tokenmill.platforms.ops.reference.moe_experts`), which a
platform overrides with a fused kernel. The weights of every expert are stacked in one
tensor per projection, in the op's layout: `w13` [E, 2I, H] (each expert's gate rows,
then its up rows) and `w2` [E, H, I]. Checkpoints that store experts otherwise (gpt-oss:
transposed and gate/up interleaved; Qwen/Mixtral: one tensor per expert) are converted
once at load by the model family's weight mapping.

Over several ranks a layer is built at its share (the model's `LayerBuilder.experts`,
core/model/linear.py, says which):

- tensor parallel (`moe_tp` group of t ranks): every expert's intermediate dim is split,
  each rank holding rows [r I/t, (r+1) I/t) of its gate and of its up projection and
  those columns of its down projection; the ranks' partial outputs are all-reduced (the
  down bias is added by rank 0 alone, so it counts once).
- expert parallel (`ep` group of n ranks, `enable_expert_parallel`): rank r holds experts
  [r E/n, (r+1) E/n) whole. The step's tokens, replicated on every rank, are split into
  n contiguous slices; each rank routes its slice, sends every (token, expert) row to the
  expert's owner (all-to-all dispatch: the row counts first, then the rows and their
  local expert ids), runs its experts on what it received, sends the outputs back
  (all-to-all combine), weights and sums them per token, and the slices are all-gathered
  so every rank again holds every token's output.

Shared experts (DeepSeek, Kimi, Qwen3-Next) are built by their family split by their
intermediate dim under TP and unreduced (`GatedMLP(partial=True)`, `shared_partial`);
their partial sum joins the routed one's reduction (`combine`). Under sequence parallel the layer all-gathers its token slice first (TP)
and reduce-scatters its output, or (EP) routes the rank's own slice and skips the
final all-gather.

Weights are narrowed to the rank's share as they load (`load_checkpoint_tensor`): a rank
never copies another rank's experts (or intermediate rows) to its device.

Quantized experts (an AWQ / GPTQ / FP8 checkpoint's, `tokenmill.model.quant.QuantizedExperts`)
are stored per projection as the contract's codes, scales and offsets stacked over the
experts (`w13_codes` [E, 2I, H / 2] for int4, `w13_scales` [E, 2I, H / g], ...) and run
expert by expert through the platform's quantized linear; they are not split over ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.linear import LayerBuilder
from tokenmill.model.parallel import check_moe_parallel
from tokenmill.platforms.ops import Ops

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


# the parameters split by expert (and by intermediate row under TP); the quantized
# experts' parts (`w13_codes`, ...) load as their projection does, one row per output
_QUANT_PARTS = ("codes", "scales", "offsets")
_PROJ_PARAMS = {f"{w}{suffix}": w for w in ("w13", "w2")
                for suffix in ("", *(f"_{part}" for part in _QUANT_PARTS))}
_EXPERT_PARAMS = (*_PROJ_PARAMS, "w13_bias", "w2_bias")


class FusedMoE(nn.Module):
    """A router (Linear hidden -> E) and E experts, each a gated MLP hidden -> I -> hidden.

    `forward(x)`: x [T, hidden] -> [T, hidden], the same on every rank. Parameters, at this
    rank's share (E_r experts, I_r intermediate rows; see the module docstring):
    `router.weight` [E, H] (+ `router.bias` [E]), `w13` [E_r, 2 I_r, H], `w2` [E_r, H, I_r]
    (+ `w13_bias` [E_r, 2 I_r], `w2_bias` [E_r, H]). Sizes are the model's whole ones.
    With "sigmoid_group_topk" routing the router runs in float32 and the layer has
    `e_score_correction_bias` (float32 [E]). `shared_experts` (DeepSeek, Kimi, Qwen MoE):
    a module every token goes through beside its routed experts; its output is added
    (`shared_partial`: it is this rank's partial sum over the TP group, built sharded by
    its family, and joins the routed experts' one reduction).
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
        build: LayerBuilder,
        prefix: str,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        num_groups: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        shared_experts: nn.Module | None = None,
        shared_partial: bool = False,
    ) -> None:
        super().__init__()
        if routing not in ROUTING:
            raise ValueError(f"routing {routing!r} is not one of {ROUTING}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        shard = build.experts(prefix, num_experts, intermediate_size)
        self.ep, self.tp = shard.ep, shard.tp
        check_moe_parallel(num_experts, intermediate_size, self.ep.world_size, self.tp.world_size)
        if not shard.scheme.splits_experts and (self.ep.world_size > 1 or self.tp.world_size > 1):
            raise ValueError(
                f"{prefix}: {type(shard.scheme).__name__} experts are not split over ranks yet (expert "
                f"parallel size {self.ep.world_size}, MoE tensor parallel size "
                f"{self.tp.world_size}); run with one rank or --quantization none")
        # under sequence parallel: a TP layer gathers its input and reduce-scatters its
        # output, an EP layer routes the rank's own token slice (the module docstring)
        self.sp = build.sp
        # the shared experts' output is a partial sum over this TP group (see combine)
        self.shared_tp = build.tp if shared_partial and build.sharded else None
        self.num_experts, self.top_k = num_experts, top_k
        self.routing, self.renormalize, self.activation = routing, renormalize, activation
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.router = build.replicated(f"{prefix}.router", hidden_size, num_experts, router_bias)
        self.num_local_experts, self.first_expert = shard.num_local_experts, shard.first_expert
        self.local_intermediate = shard.local_intermediate
        self.intermediate_start = shard.intermediate_start
        self.intermediate_size = intermediate_size
        self.scheme = shard.scheme
        self.scheme.create_experts(self, self.num_local_experts, self.local_intermediate,
                                   hidden_size, expert_bias)
        self.e_score_correction_bias = None
        if routing == "sigmoid_group_topk":
            # float32 as in the checkpoint: a rounded bias could change which experts win
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32)
            )
        self.num_groups, self.topk_group = num_groups, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.shared_experts = shared_experts
        self.ops = build.ops
        self._apply_packed: Callable[..., torch.Tensor] | None = None

    def prepack(self, ops: Ops) -> None:
        """Let the platform repack the loaded experts (the scheme's `prepack_experts`);
        call after every weight update. Until then (and for dense experts, whose op
        `moe_experts` is the platform's already) the scheme's `apply_experts` runs."""
        self._apply_packed = self.scheme.prepack_experts(self, ops)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.routing == "sigmoid_group_topk":  # DeepSeek routes in float32
            bias = None if self.router.bias is None else self.router.bias.float()
            return F.linear(x.float(), self.router.weight.float(), bias)
        return self.router(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sp = self.sp
        if sp is not None and self.ep.world_size == 1:
            x = sp.gather(x)  # every rank's slice of every expert needs every token
        routed, partial = self.routed(x)
        shared = None
        if self.shared_experts is not None:
            split = sp is not None and self.ep.world_size > 1  # x is this rank's token slice
            # sharded shared experts need every token on every rank (reduce-scattered back)
            shared = self.shared_experts(sp.gather(x) if split else x)
        return self.combine(routed, partial, shared)

    def routed(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The routed experts' output for `x`, and whether it is still a partial sum over
        the `moe_tp` ranks (each holding a slice of every expert's intermediate dim).
        Under expert parallel it is whole: combined all-to-all, and, unless `x` is a
        sequence-parallel token slice already, all-gathered."""
        if self.ep.world_size > 1:
            return self._forward_expert_parallel(x), False
        weights, ids = self._route(x)
        routed = self._experts(x, weights, ids, with_down_bias=self.tp.rank_in_group == 0)
        return routed, self.tp.world_size > 1

    def combine(
        self, routed: torch.Tensor, partial: bool, shared: torch.Tensor | None
    ) -> torch.Tensor:
        """Routed plus shared output, reduced once. The shared experts' output is a
        partial sum over the TP group when its family built them split (`shared_tp`):
        with the routed partial (same group) it joins one all-reduce, beside a whole
        routed output (EP) it is reduced alone. Under sequence parallel the reduction is
        a reduce-scatter to this rank's tokens."""
        if shared is not None and self.shared_tp is None:  # whole on every rank
            routed = self._reduce(routed) if partial else routed
            return routed + shared
        if shared is None:
            return self._reduce(routed) if partial else routed
        if partial:
            return self._reduce(routed + shared)
        return routed + self._reduce(shared)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.sp is not None:
            return self.sp.scatter(partial)
        tp = self.shared_tp or self.tp
        return tp.communicator.all_reduce(partial)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(
            self.router_logits(x), self.top_k, self.routing, self.renormalize,
            correction_bias=self.e_score_correction_bias, num_groups=self.num_groups,
            topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
        )

    def _experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, with_down_bias: bool
    ) -> torch.Tensor:
        """This rank's experts through their weight scheme (dense: the op `moe_experts`);
        `ids` are local expert ids."""
        if self._apply_packed is not None:
            return self._apply_packed(x, weights, ids, with_down_bias)
        return self.scheme.apply_experts(self, x, weights, ids, with_down_bias)

    def _forward_expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """Dispatch this rank's slice of the tokens to the experts' owners, combine the
        outputs back, all-gather the slices (the module docstring's steps)."""
        comm, n = self.ep.communicator, self.ep.world_size
        sp = self.sp
        num_tokens = x.shape[0]
        chunk = -(-num_tokens // n)
        lo = min(self.ep.rank_in_group * chunk, num_tokens)
        # under sequence parallel `x` is this rank's slice of the tokens already (the same
        # contiguous split, padded): route it all and hand back the slice
        local = x if sp is not None else x[lo : min(lo + chunk, num_tokens)]
        weights, ids = self._route(local)
        flat_ids = ids.flatten()
        owner = flat_ids // self.num_local_experts
        order = torch.argsort(owner, stable=True)  # rows grouped by destination rank
        send_counts = torch.bincount(owner, minlength=n)
        recv_counts = comm.all_to_all(send_counts)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        token_of = order // self.top_k
        rows = comm.all_to_all_single(local[token_of], recvs, sends)
        local_ids = comm.all_to_all_single(
            (flat_ids[order] % self.num_local_experts).unsqueeze(1), recvs, sends
        )
        # every received row through its one expert, unweighted (the sender weights it)
        ones = torch.ones(local_ids.shape, dtype=torch.float32, device=x.device)
        outputs = self._experts(rows, ones, local_ids, with_down_bias=True)
        returned = comm.all_to_all_single(outputs, sends, recvs)
        per_pick = torch.empty_like(returned)
        per_pick[order] = returned  # back in (token, j) order
        combined = torch.zeros((local.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
        picks = per_pick.view(local.shape[0], self.top_k, x.shape[1]).float()
        for j in range(self.top_k):
            combined += picks[:, j] * weights[:, j, None]
        if sp is not None:
            return combined.to(x.dtype)
        padded = x.new_zeros((chunk, x.shape[1]))
        padded[: local.shape[0]] = combined.to(x.dtype)
        return comm.all_gather(padded)[:num_tokens]

    # ---- loading ------------------------------------------------------------------------
    def checkpoint_shards(self, param_name: str) -> list[int | None]:
        """The shards of `param_name` this rank must load: per-expert checkpoints give
        expert e's gate as w13 shard 2e, its up as 2e + 1 and its down as w2 shard e
        (global expert ids); stacked checkpoints give the whole tensor (shard None),
        which covers them all."""
        experts = range(self.first_expert, self.first_expert + self.num_local_experts)
        proj = _PROJ_PARAMS.get(param_name)
        if proj == "w13":
            return [2 * e + part for e in experts for part in (0, 1)]
        if proj == "w2":
            return list(experts)
        return [None]

    def load_checkpoint_tensor(
        self, param_name: str, shard: int | None, tensor: torch.Tensor
    ) -> list[int | None]:
        """Copy this rank's share of checkpoint `tensor` (in the op's layout; shard as in
        `checkpoint_shards`) into `param_name`; returns the shards it filled ([] for
        another rank's expert). ValueError naming the shapes on a mismatch."""
        param = getattr(self, param_name)
        if param_name not in _EXPERT_PARAMS:  # whole on every rank (the correction bias)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"{param_name} expects {tuple(param.shape)}, got {tuple(tensor.shape)}"
                )
            param.data.copy_(tensor)
            return [None]
        e0, ne = self.first_expert, self.num_local_experts
        i0, ni, full = self.intermediate_start, self.local_intermediate, self.intermediate_size
        proj = _PROJ_PARAMS.get(param_name)
        # a quantized part's columns are packed codes or groups: never split (one rank)
        split_columns = param_name == "w2"
        if shard is None:
            filled = self.checkpoint_shards(param_name)
            if tensor.shape[0] != self.num_experts:
                raise ValueError(
                    f"{param_name} expects {self.num_experts} stacked experts, got a checkpoint "
                    f"tensor of {tuple(tensor.shape)}"
                )
            part = tensor.narrow(0, e0, ne)
            if param_name in ("w13", "w13_bias"):  # gate rows then up rows, each narrowed
                part = torch.cat((part.narrow(1, i0, ni), part.narrow(1, full + i0, ni)), dim=1)
            elif split_columns:
                part = part.narrow(2, i0, ni)
            target = param.data
        else:
            expert = shard // 2 if proj == "w13" else shard
            if not 0 <= expert < self.num_experts:
                raise KeyError(f"{param_name} shard {shard}: expert {expert} of {self.num_experts}")
            if not e0 <= expert < e0 + ne:
                return []  # another rank's expert
            filled = [shard]
            if proj == "w13":
                part = tensor.narrow(0, i0, ni)
                target = param.data[expert - e0, (shard % 2) * ni : (shard % 2 + 1) * ni]
            else:
                part = tensor.narrow(1, i0, ni) if split_columns else tensor
                target = param.data[expert - e0]
        if tuple(part.shape) != tuple(target.shape):
            raise ValueError(
                f"{param_name} (shard {shard}) expects {tuple(target.shape)} on this rank, got "
                f"{tuple(part.shape)} from a checkpoint tensor of {tuple(tensor.shape)}"
            )
        target.copy_(part)
        return filled


# per-expert checkpoint projection -> (our FusedMoE parameter, part: 0 gate, 1 up, None down)
_PER_EXPERT = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}


def expert_param(prefix: str, leaf: str) -> tuple[str, int | None] | None:
    """`{prefix}.experts.{e}.{proj}.weight` or `{prefix}.experts.{stacked}` -> the FusedMoE
    parameter under `prefix` and its shard (numbering: FusedMoE.checkpoint_shards); None
    for other names. `leaf` is the name after `{prefix}.experts.`. Per-expert checkpoints
    (Qwen, DeepSeek, Mixtral) and transformers 5's stacked in-memory names both load."""
    parts = leaf.split(".")
    if len(parts) == 3 and parts[0].isdigit() and parts[1] in _PER_EXPERT and parts[2] == "weight":
        param, part = _PER_EXPERT[parts[1]]
        expert = int(parts[0])
        return f"{prefix}.{param}", expert if part is None else 2 * expert + part
    if len(parts) == 1 and parts[0] in _STACKED:
        return f"{prefix}.{_STACKED[parts[0]]}", None
    return None


def deinterleave_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gate/up alternating along `dim` (g0 u0 g1 u1 ...) -> all gates, then all ups."""
    dim = dim % t.dim()
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)
