"""The model's matmul layers and their one construction point, `LayerBuilder`.

Every family builds its linear layers, embeddings and experts through the `LayerBuilder`
its `CausalLM` hands it (never these classes directly), which holds the rank's parallel
state and each layer's weight scheme:

- `replicated(prefix, in, out, bias)`: the whole matrix on every rank.
- `column(prefix, in, out, bias, shards=, gather=)`: the output features split over the
  TP ranks; `out` is this rank's (a list for a fused projection: q, k, v or gate, up).
- `row(prefix, in, out, bias, reduce=)`: the input features split; the ranks' partial
  sums are all-reduced (reduce-scattered along the tokens under sequence parallel)
  before the whole bias is added, or, with `reduce=False`, left for the caller.
- `embedding(prefix, vocab, hidden)` / `lm_head(prefix, hidden, vocab)`: the vocab rows
  split in blocks of ceil(vocab / t), the last zero-padded.
- `experts(prefix, num_experts, intermediate)`: the share of a `FusedMoE`'s experts this
  rank holds (whole experts under expert parallel, else a slice of every expert's
  intermediate dim) and their weight scheme.

Each layer is built at this rank's shapes and is told at construction which part of each
checkpoint tensor it holds (`shard_rules`: a `Slice` or `Pieces` per parameter, or a list
with one per fused part); `CausalLM.load_weights` narrows every checkpoint tensor by it
(`parallel.narrow_for_rank`) before the copy. With one rank there are no rules and no
collectives: the layers are the plain ones.

Weight schemes: `prefix` is the layer's module name as the model names its parameters
(`model.layers.3.self_attn.qkv_proj`); the builder asks `schemes(prefix)` for the layer's
`WeightScheme`, which creates its parameters, runs its matmul and prepacks it for the
platform. `DenseWeights` (weights in the model dtype, `F.linear`) is the default; a
quantized scheme (int4 groups, FP8 blocks) is another `WeightScheme`, chosen per layer
here, with no family touched.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import GroupCoordinator, ParallelState
from tokenmill.model.parallel import (
    HeadShards,
    SequenceParallel,
    ShardRule,
    Slice,
    padded_vocab_shard,
)
from tokenmill.platforms.ops import Ops


class WeightScheme(abc.ABC):
    """How one layer stores and multiplies its weights (see the module docstring).

    `create` registers the layer's parameters (at least `weight`, and `bias` or None);
    `apply` computes x @ W.T (+ bias); `prepack` returns the platform's packed matmul
    for the loaded weights, or None to keep `apply`. For a `FusedMoE`'s stacked experts,
    `create_experts` registers them and `apply_experts` runs the picked experts of each
    token row (the op `moe_experts`'s contract); `prepack_experts` returns the platform's
    packed form of `apply_experts`, or None to keep it. `splits_experts`: whether the
    experts may be split over expert- or tensor-parallel ranks.
    """

    splits_experts: ClassVar[bool] = True

    @abc.abstractmethod
    def create(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        """See the class docstring."""

    @abc.abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """See the class docstring."""

    @abc.abstractmethod
    def prepack(
        self, layer: nn.Module, ops: Ops, bias: torch.Tensor | None
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """See the class docstring."""

    @abc.abstractmethod
    def create_experts(
        self, layer: nn.Module, num_experts: int, intermediate: int, hidden: int, bias: bool
    ) -> None:
        """See the class docstring."""

    @abc.abstractmethod
    def apply_experts(
        self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
        with_down_bias: bool,
    ) -> torch.Tensor:
        """See the class docstring (`ids`: the layer's local expert ids [T, k])."""

    def prepack_experts(
        self, layer: nn.Module, ops: Ops
    ) -> Callable[..., torch.Tensor] | None:
        """See the class docstring; None by default (`apply_experts` runs: the dense
        experts' op `moe_experts` is the platform's already)."""
        return None


@dataclasses.dataclass(frozen=True)
class DenseWeights(WeightScheme):
    """Weights stored as they are used, in `dtype`; the matmul is `F.linear` until the
    platform's `prepack_linear` takes over. Weights start uninitialised: the checkpoint
    fills them (a random init of a large model would cost seconds for nothing)."""

    dtype: torch.dtype

    def create(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=self.dtype))
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=self.dtype)) if bias else None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def prepack(
        self, layer: nn.Module, ops: Ops, bias: torch.Tensor | None
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return ops.prepack_linear(layer.weight, bias)

    def create_experts(
        self, layer: nn.Module, num_experts: int, intermediate: int, hidden: int, bias: bool
    ) -> None:
        """`w13` [E, 2 I, H] (gate rows then up rows), `w2` [E, H, I], and their biases."""
        e, i, h, dtype = num_experts, intermediate, hidden, self.dtype
        layer.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype))
        layer.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype))
        layer.w13_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype)) if bias else None
        layer.w2_bias = nn.Parameter(torch.empty(e, h, dtype=dtype)) if bias else None

    def apply_experts(
        self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
        with_down_bias: bool,
    ) -> torch.Tensor:
        return layer.ops.moe_experts(
            x, layer.w13, layer.w2, weights, ids, w13_bias=layer.w13_bias,
            w2_bias=layer.w2_bias if with_down_bias else None, activation=layer.activation,
            swiglu_alpha=layer.swiglu_alpha, swiglu_limit=layer.swiglu_limit,
        )


Rules = Mapping[str, ShardRule | list[ShardRule]]


class Linear(nn.Module):
    """y = x @ W.T (+ b) over this rank's share of W, in its weight scheme. `gather`
    (sequence parallel): the input is this rank's token slice, all-gathered first."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, scheme: WeightScheme, *,
        shard_rules: Rules | None = None, gather: SequenceParallel | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme = scheme
        scheme.create(self, in_features, out_features, bias)
        # which part of each checkpoint tensor this rank's parameter holds (none: all)
        self.shard_rules: Rules = dict(shard_rules or {})
        self.gather = gather
        self._apply_packed = None

    def prepack(self, ops: Ops) -> None:
        """Let the platform repack the loaded weights (the scheme's `prepack`); call after
        every weight update. Until then, and for weights changed later, forward runs the
        scheme's `apply`."""
        self._apply_packed = self.scheme.prepack(self, ops, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather is not None:
            x = self.gather.gather(x)
        if self._apply_packed is not None:
            return self._apply_packed(x)
        return self.scheme.apply(self, x, self.bias)


class MergedLinear(Linear):
    """A `Linear` whose weight stacks several checkpoint matrices along the output dim.

    `output_sizes` are the row counts of the stacked matrices, in order (q, k, v or gate,
    up), at this rank's shapes; `load_shard` copies a checkpoint tensor into its rows.
    """

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], bias: bool, scheme: WeightScheme,
        **kwargs: Any,
    ) -> None:
        self.output_sizes = list(output_sizes)
        self.offsets = [0]
        for size in self.output_sizes:
            self.offsets.append(self.offsets[-1] + size)
        super().__init__(in_features, self.offsets[-1], bias, scheme, **kwargs)

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy `tensor` into rows of shard `shard` of `weight` or `bias` (cast to its dtype)."""
        param = getattr(self, param_name)
        lo, hi = self.offsets[shard], self.offsets[shard + 1]
        target = param.data[lo:hi]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"shard {shard} of {param_name} expects shape {tuple(target.shape)}, "
                f"got {tuple(tensor.shape)}"
            )
        target.copy_(tensor)


class RowParallelLinear(Linear):
    """A linear whose input features are split across the TP group: each rank multiplies
    its slice, the partial sums are all-reduced (reduce-scattered along the tokens under
    sequence parallel `sp`), then the (whole, replicated) bias is added."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, scheme: WeightScheme, *,
        tp: GroupCoordinator, sp: SequenceParallel | None, shard_rules: Rules,
    ) -> None:
        super().__init__(in_features, out_features, bias, scheme, shard_rules=shard_rules)
        self.tp, self.sp = tp, sp

    def prepack(self, ops: Ops) -> None:
        self._apply_packed = self.scheme.prepack(self, ops, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._apply_packed is not None:
            partial = self._apply_packed(x)
        else:
            partial = self.scheme.apply(self, x, None)
        out = self.tp.communicator.all_reduce(partial) if self.sp is None else self.sp.scatter(partial)
        return out if self.bias is None else out + self.bias


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden], uninitialised until loaded."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))
        self.shard_rules: Rules = {}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class VocabParallelEmbedding(Embedding):
    """This rank's block of embedding rows; ids outside it look up zeros, and the ranks'
    lookups are all-reduced so every rank gets every token's row (reduce-scattered: its
    slice of the tokens, under sequence parallel)."""

    def __init__(
        self, rows: Slice, embedding_dim: int, dtype: torch.dtype, tp: GroupCoordinator,
        sp: SequenceParallel | None,
    ) -> None:
        super().__init__(rows.padded, embedding_dim, dtype)
        self.vocab_start = rows.start
        self.shard_rules = {"weight": rows}
        self.tp, self.sp = tp, sp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.communicator.all_reduce(rows) if self.sp is None else self.sp.scatter(rows)


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """What a `FusedMoE` of `num_experts` experts of `intermediate_size` holds on this
    rank: experts [first_expert, first_expert + num_local_experts), and of each the
    intermediate rows [intermediate_start, + local_intermediate)."""

    ep: GroupCoordinator  # the experts are split over it (a group of one without EP)
    tp: GroupCoordinator  # each expert's intermediate dim is split over it
    first_expert: int
    num_local_experts: int
    intermediate_start: int
    local_intermediate: int
    scheme: WeightScheme


SchemeChooser = Callable[[str], WeightScheme]


class LayerBuilder:
    """The construction point of a model's linear layers (see the module docstring).

    `parallel`: this rank's groups; `schemes(prefix)`: each layer's weight scheme (default
    `DenseWeights(dtype)` for every layer); `heads`: this rank's attention heads and
    `vocab`: its embedding rows, both from the whole model's config (the family's layers
    see its rank-local config); `sp`: sequence parallel's token split, when on.
    """

    def __init__(
        self, *, ops: Ops, dtype: torch.dtype, parallel: ParallelState | None = None,
        schemes: SchemeChooser | None = None, heads: HeadShards | None = None,
        vocab_size: int | None = None, sequence_parallel: bool = False,
    ) -> None:
        self.ops, self.dtype = ops, dtype
        self.parallel = parallel if parallel is not None else ParallelState.single()
        self.tp = self.parallel.tp
        dense = DenseWeights(dtype)
        self._schemes = schemes or (lambda prefix: dense)
        self.heads = heads
        t, rank = self.tp.world_size, self.tp.rank_in_group
        self.vocab: Slice | None = None
        if t > 1 and vocab_size is not None:
            rows = padded_vocab_shard(vocab_size, t)
            self.vocab = Slice(0, rank * rows, min(rows, vocab_size - rank * rows), rows)
        self.sp = SequenceParallel(self.tp) if sequence_parallel and t > 1 else None

    @property
    def sharded(self) -> bool:
        """Whether tensor parallel splits the layers (more than one TP rank)."""
        return self.tp.world_size > 1

    def scheme(self, prefix: str) -> WeightScheme:
        return self._schemes(prefix)

    def rules(self, rules: Rules) -> Rules:
        """`rules` under tensor parallel; none with one rank (every tensor whole)."""
        return dict(rules) if self.sharded else {}

    def replicated(self, prefix: str, in_features: int, out_features: int, bias: bool) -> Linear:
        return Linear(in_features, out_features, bias, self.scheme(prefix))

    def column(
        self, prefix: str, in_features: int, out_features: int | Sequence[int], bias: bool, *,
        shards: ShardRule | list[ShardRule] | None = None, gather: bool = False,
        dense: bool = False,
    ) -> Linear:
        """Output rows split over the TP ranks. `out_features`: this rank's rows (a list:
        one size per fused part). `shards`: the checkpoint rows this rank holds (default
        part i's rows [rank n_i, (rank + 1) n_i)). `gather`: under sequence parallel the
        input arrives as this rank's token slice and is all-gathered first. `dense`: the
        module reads `weight` as a tensor (MLA's up-projections), so it is built dense
        in `dtype` whatever `schemes` says (a quantized checkpoint weight is dequantized
        at load)."""
        rank = self.tp.rank_in_group
        if shards is None:
            sizes = [out_features] if isinstance(out_features, int) else list(out_features)
            parts = [Slice(0, rank * n, n) for n in sizes]
            shards = parts[0] if isinstance(out_features, int) else parts
        rules = self.rules({"weight": shards, "bias": shards})
        gathered = self.sp if gather else None
        scheme = DenseWeights(self.dtype) if dense else self.scheme(prefix)
        if isinstance(out_features, int):
            return Linear(in_features, out_features, bias, scheme,
                          shard_rules=rules, gather=gathered)
        return MergedLinear(in_features, out_features, bias, scheme,
                            shard_rules=rules, gather=gathered)

    def row(
        self, prefix: str, in_features: int, out_features: int, bias: bool, *,
        reduce: bool = True,
    ) -> Linear:
        """Input columns split over the TP ranks (`in_features`: this rank's). `reduce`
        False: the output is this rank's partial sum, for the caller to reduce (a MoE's
        shared experts, whose sum joins the routed experts' one reduction)."""
        cols = self.rules({"weight": Slice(1, self.tp.rank_in_group * in_features, in_features)})
        if not self.sharded:
            return Linear(in_features, out_features, bias, self.scheme(prefix))
        if not reduce:
            if bias:
                raise ValueError(f"{prefix}: an unreduced row-parallel layer cannot carry a "
                                 "bias (each of the t ranks would add it)")
            return Linear(in_features, out_features, bias, self.scheme(prefix), shard_rules=cols)
        return RowParallelLinear(in_features, out_features, bias, self.scheme(prefix),
                                 tp=self.tp, sp=self.sp, shard_rules=cols)

    def embedding(self, prefix: str, num_embeddings: int, embedding_dim: int) -> Embedding:
        """The token embedding; under TP this rank's block of `vocab` rows
        (`num_embeddings` is then the padded block size of the rank-local config)."""
        if self.vocab is None:
            return Embedding(num_embeddings, embedding_dim, self.dtype)
        return VocabParallelEmbedding(self.vocab, embedding_dim, self.dtype, self.tp, self.sp)

    def lm_head(self, prefix: str, in_features: int, vocab_rows: int) -> Linear:
        """The LM head: under TP this rank's block of vocab rows (zero-padded), whose
        logits the model all-gathers."""
        rules = {} if self.vocab is None else {"weight": self.vocab}
        return Linear(in_features, vocab_rows, False, self.scheme(prefix), shard_rules=rules)

    def attention_shards(self, q_rows: int, head_size: int) -> list[ShardRule]:
        """The checkpoint rows of a fused q / k / v projection this rank holds: its
        `q_rows` query rows, and its KV heads (`heads`: replicated when there are fewer
        KV heads than ranks)."""
        if not self.sharded:
            return []
        if self.heads is None:
            raise ValueError("a tensor-parallel LayerBuilder needs the model's attention heads "
                             "(heads=head_shards(...)) to shard an attention layer")
        rank, heads = self.tp.rank_in_group, self.heads
        kv = Slice(0, heads.kv_head_start * head_size, heads.num_kv_heads * head_size)
        return [Slice(0, rank * q_rows, q_rows), kv, kv]

    def experts(self, prefix: str, num_experts: int, intermediate_size: int) -> ExpertShard:
        state = self.parallel
        ep, tp = state.ep, state.moe_tp
        e = num_experts // ep.world_size
        i = intermediate_size // tp.world_size
        return ExpertShard(ep, tp, ep.rank_in_group * e, e, tp.rank_in_group * i, i,
                           self.scheme(prefix))
