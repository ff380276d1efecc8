"""Tensor parallelism: what each rank owns, and the helpers its layers share.

A model is built for tensor parallel size t in one pass, in `CausalLM.__init__`:

1. the family's `local_config` (the generic one here, plus the family's own rule)
   shrinks the HF config to one rank's share (heads, KV heads, intermediate size, vocab
   rows, and the family's own widths), so every layer comes out at its per-rank shape
   and the KV cache holds this rank's KV heads only;
2. the layers are built through the model's `LayerBuilder` (core/model/linear.py), which
   makes qkv / gate_up column-parallel, o_proj / down_proj row-parallel (all-reduced),
   the embedding vocab-parallel, and gives each sharded module, at construction, the
   rule saying which slice of each checkpoint tensor it owns (`shard_rules`);
3. `load_weights` narrows each checkpoint tensor to that slice (`narrow_for_rank`)
   before copying it to the device: a rank's device only ever holds its own shard.

Heads: query heads split evenly (num_heads % t == 0). KV heads split evenly when there
are at least t of them (num_kv_heads % t == 0); with fewer, each KV head is replicated on
t / num_kv_heads consecutive ranks (t % num_kv_heads == 0), so a rank's query heads always
find their KV head locally. Vocab rows are split in ceil(vocab / t) blocks, the last
zero-padded; logits are all-gathered on every rank and the padding cut off.

Families beyond the llama layer give their own modules their rules (MLA, Gated DeltaNet,
KDA, Mamba2: `Pieces` for a share that is several runs of one checkpoint tensor); a MoE's
shared experts are split like a dense MLP but not reduced on their own: their partial sum
joins the routed experts' in one all-reduce (`FusedMoE.combine`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import GroupCoordinator

# a MoE family's expert sizes: (the config attribute of the experts' intermediate size,
# of their count). FusedMoE shards its own experts (core/model/moe.py), so local_config
# leaves these alone.
MoeSizes = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class Slice:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a checkpoint tensor,
    zero-padded to `padded` along that dim (vocab shards)."""

    dim: int
    start: int
    length: int
    padded: int | None = None


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Several `Slice`s of one dim, concatenated in order: a parameter whose rank share
    is not contiguous in the checkpoint (Gated DeltaNet's conv channels: this rank's q,
    then its k, then its v channels)."""

    slices: tuple[Slice, ...]


# which part of one checkpoint tensor a rank's parameter holds
ShardRule = Slice | Pieces


@dataclasses.dataclass(frozen=True)
class HeadShards:
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads (1 when replicated)
    kv_head_start: int  # the first checkpoint KV head this rank holds


def head_shards(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShards:
    """This rank's query and KV heads; ValueError naming the sizes when t does not fit."""
    if num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's {num_heads} attention heads"
        )
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the model's {num_kv_heads} KV heads"
            )
        local_kv = num_kv_heads // tp
        return HeadShards(num_heads // tp, local_kv, rank * local_kv)
    if tp % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} is not a multiple of the model's {num_kv_heads} KV "
            "heads, so they cannot be replicated evenly"
        )
    return HeadShards(num_heads // tp, 1, rank // (tp // num_kv_heads))


def padded_vocab_shard(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp)


def local_config(
    hf_config: Any, tp: int, expert_parallel: bool = False, *, moe: MoeSizes | None = None,
    shrink: Callable[[Any, Any, int], None] | None = None,
) -> Any:
    """A copy of `hf_config` with one rank's heads, dense intermediate size and vocab rows;
    `shrink(local, hf_config, tp)`, the family's own rule, shrinks its other widths
    (and checks they split).

    A MoE family's expert sizes (`moe`: their config attributes) stay whole (FusedMoE
    splits them itself); they are only checked here, so a bad size fails before any
    worker starts: with `expert_parallel` the experts must split over the tp ranks,
    without it their intermediate dim. ValueError naming the size that does not split.
    """
    num_heads = hf_config.num_attention_heads
    num_kv = getattr(hf_config, "num_key_value_heads", None) or num_heads
    shards = head_shards(num_heads, num_kv, tp, 0)
    moe_inter, moe_count = moe or (None, None)
    if moe_inter is not None:
        ep = tp if expert_parallel else 1
        check_moe_parallel(getattr(hf_config, moe_count), getattr(hf_config, moe_inter), ep, tp // ep)
    local = copy.deepcopy(hf_config)
    if moe_inter != "intermediate_size":  # a dense MLP's (Qwen3-MoE keeps some)
        check_divides(tp, hf_config.intermediate_size, "intermediate_size")
        local.intermediate_size = hf_config.intermediate_size // tp
    local.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    local.num_attention_heads = shards.num_heads
    local.num_key_value_heads = shards.num_kv_heads
    local.vocab_size = padded_vocab_shard(hf_config.vocab_size, tp)
    if shrink is not None:
        shrink(local, hf_config, tp)
    return local


def check_moe_parallel(num_experts: int, intermediate_size: int, ep: int, tp: int) -> None:
    """ValueError naming the sizes when the experts (EP) or their intermediate dim (TP)
    do not split evenly."""
    if num_experts % ep:
        raise ValueError(
            f"enable_expert_parallel over {ep} ranks does not divide the model's "
            f"{num_experts} experts"
        )
    if intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the experts' intermediate size "
            f"{intermediate_size}; try enable_expert_parallel"
        )


def check_divides(tp: int, size: int, what: str) -> None:
    """ValueError naming `what` and its `size` when tp ranks cannot split it evenly."""
    if size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide {what} {size}")


class SequenceParallel:
    """Sequence parallel over a TP group (Megatron's): between TP regions each rank holds
    a contiguous 1/t of the step's tokens (padded to a multiple of t), so a row-parallel
    output is reduce-scattered instead of all-reduced and a column-parallel input
    all-gathered first; the norms and residual adds in between run on 1/t of the tokens.
    The model body sets `num_tokens` at the start of each forward."""

    def __init__(self, tp: GroupCoordinator) -> None:
        self.tp = tp
        self.num_tokens = 0

    def scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial [num_tokens, ...] and keep this rank's token slice."""
        t = self.tp.world_size
        padded = -(-partial.shape[0] // t) * t
        if padded != partial.shape[0]:
            partial = F.pad(partial, [0, 0] * (partial.dim() - 1) + [0, padded - partial.shape[0]])
        return self.tp.communicator.reduce_scatter(partial, dim=0)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's token slice, concatenated and cut to the step's tokens."""
        return self.tp.communicator.all_gather(local.contiguous(), dim=0)[: self.num_tokens]


def gather_logits(local: torch.Tensor, vocab_size: int, tp: GroupCoordinator) -> torch.Tensor:
    """Every rank's block of logits [n, vocab / t], concatenated and cut to the real vocab."""
    return tp.communicator.all_gather(local.contiguous(), dim=-1)[..., :vocab_size]


def narrow_for_rank(
    module: nn.Module, param_name: str, shard: int | None, tensor: torch.Tensor
) -> torch.Tensor:
    """The part of checkpoint `tensor` this rank's `module.param_name` (fused shard `shard`)
    holds, by the `shard_rules` the module was built with; the tensor itself for an
    unsharded parameter."""
    rules = getattr(module, "shard_rules", None)
    rule = None if rules is None else rules.get(param_name)
    if rule is None:
        return tensor
    if isinstance(rule, list):
        rule = rule[shard]
    if isinstance(rule, Pieces):
        return torch.cat([tensor.narrow(p.dim, p.start, p.length) for p in rule.slices],
                         dim=rule.slices[0].dim)
    part = tensor.narrow(rule.dim, rule.start, rule.length)
    if rule.padded is not None and rule.padded > rule.length:
        pad = [0, 0] * (part.dim() - 1 - rule.dim) + [0, rule.padded - rule.length]
        part = F.pad(part, pad)
    return part
