"""Tensor parallelism for the llama-family model: what each rank owns, and its collectives.

A model is built for tensor parallel size t in three moves, all in `CausalLM.__init__`:

1. `local_config` shrinks the HF config to one rank's share (heads, KV heads,
   intermediate size, vocab rows), so the ordinary layers come out at their per-rank
   shapes: qkv_proj and gate_up_proj are then column-parallel (each rank computes its
   heads / its slice of the intermediate activations) and the KV cache holds this rank's
   KV heads only.
2. `apply_tensor_parallel` swaps o_proj and down_proj for `RowParallelLinear` (their
   partial sums are all-reduced through the TP group's communicator) and the embedding
   for `VocabParallelEmbedding`, sharing the parameters already allocated, and records on
   every sharded module which slice of each checkpoint tensor it owns (`tp_shards`).
3. `load_weights` narrows each checkpoint tensor to that slice (`narrow_for_rank`) before
   copying it to the device: a rank's device only ever holds its own shard.

Heads: query heads split evenly (num_heads % t == 0). KV heads split evenly when there
are at least t of them (num_kv_heads % t == 0); with fewer, each KV head is replicated on
t / num_kv_heads consecutive ranks (t % num_kv_heads == 0), so a rank's query heads always
find their KV head locally. Vocab rows are split in ceil(vocab / t) blocks, the last
zero-padded; logits are all-gathered on every rank and the padding cut off.

Families beyond the llama layer (their rules live beside their layers): a layer's
child module with a `shard_for_tp(tp)` method records its own `tp_shards` and swaps its
output projection for a `RowParallelLinear` (MLA, Gated DeltaNet, Qwen3-Next's MoE); a
MoE's shared experts are split like a dense MLP but not reduced on their own: their
partial sum joins the routed experts' in one all-reduce (`FusedMoE.combine`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import GroupCoordinator
from tokenmill.model.layers import Attention, GatedMLP, Linear, MergedLinear
from tokenmill.model.moe import FusedMoE, check_moe_parallel
from tokenmill.ops import Ops

TP_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "gemma3_text", "gpt_oss", "qwen3_moe", "mixtral", "deepseek_v3",
    "qwen3_next", "kimi_linear", "bamba",
)
# MoE families: (the config attribute of the experts' intermediate size, of their count).
# FusedMoE shards its own experts (core/model/moe.py), so local_config leaves these alone.
MOE_SIZES = {
    "gpt_oss": ("intermediate_size", "num_local_experts"),
    "mixtral": ("intermediate_size", "num_local_experts"),
    "qwen3_moe": ("moe_intermediate_size", "num_experts"),
    "deepseek_v3": ("moe_intermediate_size", "n_routed_experts"),
    "qwen3_next": ("moe_intermediate_size", "num_experts"),
    "kimi_linear": ("moe_intermediate_size", "num_local_experts"),
}


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


def local_config(hf_config: Any, tp: int, expert_parallel: bool = False) -> Any:
    """A copy of `hf_config` with one rank's heads, dense intermediate size and vocab rows.

    A MoE family's expert sizes stay whole (FusedMoE splits them itself); they are only
    checked here, so a bad size fails before any worker starts: with `expert_parallel`
    the experts must split over the tp ranks, without it their intermediate dim.
    """
    model_type = hf_config.model_type
    if model_type not in TP_MODEL_TYPES:
        raise ValueError(
            f"tensor parallel supports model types {TP_MODEL_TYPES}, not "
            f"{model_type!r}; use tensor_parallel_size=1"
        )
    num_heads = hf_config.num_attention_heads
    num_kv = getattr(hf_config, "num_key_value_heads", None) or num_heads
    shards = head_shards(num_heads, num_kv, tp, 0)
    moe_inter, moe_count = MOE_SIZES.get(model_type, (None, None))
    if moe_inter is not None:
        ep = tp if expert_parallel else 1
        check_moe_parallel(getattr(hf_config, moe_count), getattr(hf_config, moe_inter), ep, tp // ep)
    local = copy.deepcopy(hf_config)
    if moe_inter != "intermediate_size":  # a dense MLP's (Qwen3-MoE keeps some)
        if hf_config.intermediate_size % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide intermediate_size="
                f"{hf_config.intermediate_size}"
            )
        local.intermediate_size = hf_config.intermediate_size // tp
    local.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    local.num_attention_heads = shards.num_heads
    local.num_key_value_heads = shards.num_kv_heads
    local.vocab_size = padded_vocab_shard(hf_config.vocab_size, tp)
    if model_type == "qwen3_next":
        _shrink_qwen3_next(local, hf_config, tp)
    if model_type in ("deepseek_v3", "kimi_linear"):
        shared = hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0)
        _check_divides(tp, shared, "the shared experts' intermediate size")
    if model_type == "kimi_linear":
        _check_divides(tp, hf_config.linear_num_heads, "the model's KDA heads")
        local.linear_num_heads = hf_config.linear_num_heads // tp
    if model_type == "bamba":  # heads split with the B/C groups they read
        _check_divides(tp, hf_config.mamba_n_groups, "the model's Mamba2 groups")
        _check_divides(tp, hf_config.mamba_n_heads, "the model's Mamba2 heads")
        local.mamba_n_heads = hf_config.mamba_n_heads // tp
        local.mamba_n_groups = hf_config.mamba_n_groups // tp
    return local


def _check_divides(tp: int, size: int, what: str) -> None:
    if size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide {what} {size}")


def _shrink_qwen3_next(local: Any, hf_config: Any, tp: int) -> None:
    """Qwen3-Next's Gated DeltaNet heads (split by key-head groups: each key head with its
    value heads) and its shared expert's intermediate size."""
    _check_divides(tp, hf_config.linear_num_key_heads, "the model's Gated DeltaNet key heads")
    _check_divides(tp, hf_config.shared_expert_intermediate_size,
                   "the shared expert's intermediate size")
    local.linear_num_key_heads = hf_config.linear_num_key_heads // tp
    local.linear_num_value_heads = hf_config.linear_num_value_heads // tp
    local.shared_expert_intermediate_size = hf_config.shared_expert_intermediate_size // tp


# the MoE families included: FusedMoE gathers a TP layer's tokens and reduce-scatters its
# output, and under EP dispatches each rank's own slice; DeepSeek-V3's MLA gathers too
SP_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "gemma3_text", "gpt_oss", "qwen3_moe", "mixtral", "deepseek_v3",
)


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


def check_sequence_parallel(hf_config: Any) -> None:
    if hf_config.model_type not in SP_MODEL_TYPES:
        raise ValueError(
            f"enable_sequence_parallelism supports model types {SP_MODEL_TYPES}, not "
            f"{hf_config.model_type!r}"
        )


class RowParallelLinear(Linear):
    """A linear whose input features are split across the TP group: each rank multiplies
    its slice, the partial sums are all-reduced (reduce-scattered along the tokens under
    sequence parallel), then the (whole, replicated) bias added. Built over the
    parameters of the `Linear` it replaces (no new allocation)."""

    def __init__(
        self, weight: nn.Parameter, bias: nn.Parameter | None, tp: GroupCoordinator,
        sp: SequenceParallel | None = None,
    ):
        nn.Module.__init__(self)
        self.weight = weight
        self.bias = bias
        self.__dict__["tp"] = tp  # not a submodule
        self.__dict__["sp"] = sp
        self._apply_packed = None

    def prepack(self, ops: Ops) -> None:
        self._apply_packed = ops.prepack_linear(self.weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._apply_packed is not None:
            partial = self._apply_packed(x)
        else:
            partial = F.linear(x, self.weight)
        out = self.tp.communicator.all_reduce(partial) if self.sp is None else self.sp.scatter(partial)
        return out if self.bias is None else out + self.bias


class SequenceGatherLinear(MergedLinear):
    """A column-parallel `MergedLinear` under sequence parallel: its input, split along
    the tokens, is all-gathered first. Built over the parameters of the one it replaces."""

    def __init__(self, linear: MergedLinear, sp: SequenceParallel) -> None:
        nn.Module.__init__(self)
        self.weight, self.bias = linear.weight, linear.bias
        self.output_sizes, self.offsets = linear.output_sizes, linear.offsets
        self.__dict__["sp"] = sp
        self._apply_packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.sp.gather(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's block of embedding rows; ids outside it look up zeros, and the ranks'
    lookups are all-reduced so every rank gets every token's row (reduce-scattered: its
    slice of the tokens, under sequence parallel)."""

    def __init__(
        self, weight: nn.Parameter, vocab_start: int, tp: GroupCoordinator,
        sp: SequenceParallel | None = None,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        self.__dict__["tp"] = tp
        self.__dict__["sp"] = sp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.communicator.all_reduce(rows) if self.sp is None else self.sp.scatter(rows)


def gather_logits(local: torch.Tensor, vocab_size: int, tp: GroupCoordinator) -> torch.Tensor:
    """Every rank's block of logits [n, vocab / t], concatenated and cut to the real vocab."""
    return tp.communicator.all_gather(local.contiguous(), dim=-1)[..., :vocab_size]


def apply_tensor_parallel(
    lm: nn.Module, hf_config: Any, tp: GroupCoordinator, sequence_parallel: bool = False
) -> None:
    """Make `lm` (a `CausalLM` of any family, built from `local_config`) this rank's shard;
    with `sequence_parallel`, its TP regions exchange token slices (SequenceParallel) and
    `lm.model.sequence_parallel` is set (its forward sets the token count and gathers
    the final hidden states)."""
    sp = None
    if sequence_parallel:
        check_sequence_parallel(hf_config)
        sp = SequenceParallel(tp)
    lm.model.__dict__["sequence_parallel"] = sp
    t, rank = tp.world_size, tp.rank_in_group
    num_heads = hf_config.num_attention_heads
    num_kv = getattr(hf_config, "num_key_value_heads", None) or num_heads
    shards = head_shards(num_heads, num_kv, t, rank)
    vocab_rows = padded_vocab_shard(hf_config.vocab_size, t)
    vocab = Slice(0, rank * vocab_rows, min(vocab_rows, hf_config.vocab_size - rank * vocab_rows),
                  vocab_rows)
    body = lm.model
    body.embed_tokens = VocabParallelEmbedding(body.embed_tokens.weight, vocab.start, tp, sp)
    body.embed_tokens.tp_shards = {"weight": vocab}
    if lm.lm_head is not None:
        lm.lm_head.tp_shards = {"weight": vocab}
    for layer in body.layers:
        for module in layer.children():
            if isinstance(module, Attention):
                _shard_attention(module, shards, tp, sp)
            elif isinstance(module, GatedMLP):
                shard_gated_mlp(module, tp, sp)
            elif isinstance(module, FusedMoE):
                if sp is not None:
                    module.__dict__["sp"] = sp
                if module.shared_experts is not None:
                    shard_gated_mlp(module.shared_experts, tp, sp=None, reduce=False)
                    module.__dict__["shared_tp"] = tp  # see FusedMoE.combine
            elif hasattr(module, "shard_for_tp"):  # a family's own layer (MLA, DeltaNet)
                if sp is None:
                    module.shard_for_tp(tp)
                else:  # only SP_MODEL_TYPES' layers get here with sp (MLA takes it)
                    module.shard_for_tp(tp, sp)


def _shard_attention(attn: Attention, shards: HeadShards, tp: GroupCoordinator,
                     sp: SequenceParallel | None) -> None:
    """Query heads (with Qwen3-Next's per-head gate: the q rows of `qkv_proj`'s first
    output) and KV heads column-sharded, o_proj row-parallel, gpt-oss's sinks by head."""
    rank, head = tp.rank_in_group, attn.head_size
    q_rows = attn.qkv_proj.output_sizes[0]  # this rank's: heads x head (x 2 with a gate)
    q = Slice(0, rank * q_rows, q_rows)
    kv = Slice(0, shards.kv_head_start * head, shards.num_kv_heads * head)
    if sp is not None:
        attn.qkv_proj = SequenceGatherLinear(attn.qkv_proj, sp)
    attn.qkv_proj.tp_shards = {"weight": [q, kv, kv], "bias": [q, kv, kv]}
    attn.o_proj = RowParallelLinear(attn.o_proj.weight, attn.o_proj.bias, tp, sp)
    o_cols = attn.o_proj.weight.shape[1]
    attn.o_proj.tp_shards = {"weight": Slice(1, rank * o_cols, o_cols)}
    if attn.sinks is not None:  # gpt-oss: one sink logit per query head
        attn.tp_shards = {"sinks": Slice(0, rank * shards.num_heads, shards.num_heads)}


def shard_gated_mlp(mlp: GatedMLP, tp: GroupCoordinator, sp: SequenceParallel | None = None,
                    reduce: bool = True) -> None:
    """A gated MLP built at this rank's intermediate size: gate/up column-sharded, down
    row-sharded. `reduce` False (a MoE's shared experts): down_proj stays a plain Linear
    whose output is this rank's partial sum, for its caller to reduce."""
    rank, inter = tp.rank_in_group, mlp.down_proj.weight.shape[1]
    cols = Slice(0, rank * inter, inter)
    if sp is not None:
        mlp.gate_up_proj = SequenceGatherLinear(mlp.gate_up_proj, sp)
    mlp.gate_up_proj.tp_shards = {"weight": [cols, cols], "bias": [cols, cols]}
    if reduce:
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight, mlp.down_proj.bias, tp, sp)
    elif mlp.down_proj.bias is not None:
        raise ValueError("an unreduced row-sharded down_proj cannot carry a bias (t copies)")
    mlp.down_proj.tp_shards = {"weight": Slice(1, cols.start, cols.length)}


def narrow_for_rank(
    module: nn.Module, param_name: str, shard: int | None, tensor: torch.Tensor
) -> torch.Tensor:
    """The part of checkpoint `tensor` this rank's `module.param_name` (fused shard `shard`)
    holds; the tensor itself for an unsharded parameter."""
    rules = getattr(module, "tp_shards", None)
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
