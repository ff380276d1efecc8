"""Quantized weight schemes: a `WeightScheme` per layer, chosen through the model's one
construction point (`LayerBuilder`'s `schemes(prefix)`), no family touched.

A quantized layer holds the contract's storage (`tokenmill.platforms.ops.quant`) as
parameters named `weight_codes`, `weight_scales` and (with zero points) `weight_offsets`;
a checkpoint reader that keeps a weight quantized yields it as a
`QuantizedCheckpointTensor`, which `CausalLM.load_weights` copies part by part (fused
q/k/v and gate/up rows included: every part has one row per output feature) or, for a
layer built dense, dequantizes. The matmul is the platform's
`prepack_quantized_linear`, the reference's until prepacked.

A `FusedMoE`'s routed experts quantized in the checkpoint (one tensor per expert and
projection, each in one scheme per projection) are a `QuantizedExperts`: the parts
stacked over the experts, each expert's projection multiplied by the same op.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar

import torch
from torch import nn

from tokenmill.model.linear import DenseWeights, SchemeChooser, WeightScheme
from tokenmill.platforms.ops import Ops
from tokenmill.platforms.ops.quant import (
    QuantizedWeight,
    QuantScheme,
    dequantize,
    pack_int4,
    prepack_quantized_linear,
)
from tokenmill.platforms.ops.reference import moe_activation


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizedCheckpointTensor:
    """A checkpoint weight [out, in] kept quantized (codes unpacked here: uint8 [out, in]).

    `CausalLM.load_weights` copies its parts into a quantized layer of the same scheme,
    or dequantizes it for a dense one (`dense`)."""

    scheme: QuantScheme
    codes: torch.Tensor  # uint8 [out, in], one code per weight
    scales: torch.Tensor  # float32 [out, in / group]
    offsets: torch.Tensor | None  # float32 [out, in / group]; None: no zero points

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def parts(self) -> dict[str, torch.Tensor]:
        """The layer's parameters by name: codes in the scheme's layout, scales, offsets."""
        codes = pack_int4(self.codes) if self.scheme.bits == 4 else self.codes
        parts = {"weight_codes": codes, "weight_scales": self.scales}
        return parts if self.offsets is None else {**parts, "weight_offsets": self.offsets}

    def dense(self) -> torch.Tensor:
        """The float32 weight [out, in]."""
        out, n = self.codes.shape
        codes = self.parts()["weight_codes"]
        weight = QuantizedWeight(self.scheme, codes, self.scales, self.offsets, n, out)
        return dequantize(weight)

logger = logging.getLogger(__name__)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


@dataclasses.dataclass(frozen=True)
class QuantizedWeights(WeightScheme):
    """A layer stored as `quant` describes; activations, bias and outputs in `dtype`."""

    quant: QuantScheme
    dtype: torch.dtype

    def create(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        q = self.quant
        codes_dtype = torch.float8_e4m3fn if q.is_fp8 else torch.uint8
        layer.weight_codes = _frozen(torch.empty(q.codes_shape(out_features, in_features),
                                          dtype=codes_dtype))
        scales = q.scales_shape(out_features, in_features)
        layer.weight_scales = _frozen(torch.empty(scales, dtype=torch.float32))
        layer.weight_offsets = (_frozen(torch.empty(scales, dtype=torch.float32))
                         if q.zero_points and not q.is_fp8 else None)
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=self.dtype)) if bias else None

    def weight(self, layer: nn.Module) -> QuantizedWeight:
        """The layer's weight as the ops take it."""
        return QuantizedWeight(self.quant, layer.weight_codes, layer.weight_scales,
                               layer.weight_offsets,
                               layer.in_features, layer.out_features)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return prepack_quantized_linear(self.weight(layer), bias)(x)

    def prepack(
        self, layer: nn.Module, ops: Ops, bias: torch.Tensor | None
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return ops.prepack_quantized_linear(self.weight(layer), bias)

    def create_experts(
        self, layer: nn.Module, num_experts: int, intermediate: int, hidden: int, bias: bool
    ) -> None:
        raise TypeError(f"QuantizedWeights ({self.quant.format}) is a linear layer's "
                        "scheme; a FusedMoE's quantized experts are QuantizedExperts")

    def apply_experts(self, layer, x, weights, ids, with_down_bias):  # pragma: no cover
        raise TypeError("QuantizedWeights is a linear layer's scheme, not a FusedMoE's")


Linears = list[tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]]


@dataclasses.dataclass(frozen=True)
class QuantizedExperts(WeightScheme):
    """A `FusedMoE`'s routed experts stored as the checkpoint quantized them: gate and up
    (`w13`, each expert's gate rows then its up rows) in scheme `w13`, down (`w2`) in
    scheme `w2`; activations, biases and outputs in `dtype`. The parts are stacked over
    the experts: `w13_codes` [E, *codes_shape(2I, H)], `w13_scales` / `w13_offsets`
    [E, *scales_shape(2I, H)], `w2_*` likewise for [H, I] (offsets None without zero
    points). Each expert's projection is one `QuantizedWeight` (views of its rows of the
    stack), multiplied by the platform's `prepack_quantized_linear` (the reference's
    until prepacked); the experts are not split over ranks (`splits_experts`)."""

    w13: QuantScheme
    w2: QuantScheme
    dtype: torch.dtype
    splits_experts: ClassVar[bool] = False

    def projection(self, name: str) -> QuantScheme | None:
        """The scheme of projection `name` ("w13" or "w2"; None for another name)."""
        return {"w13": self.w13, "w2": self.w2}.get(name)

    def _linear_only(self) -> TypeError:
        return TypeError("QuantizedExperts is a scheme of a FusedMoE's experts, not of a "
                         "linear layer")

    def create(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        raise self._linear_only()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise self._linear_only()

    def prepack(self, layer: nn.Module, ops: Ops, bias: torch.Tensor | None) -> None:
        raise self._linear_only()

    def create_experts(
        self, layer: nn.Module, num_experts: int, intermediate: int, hidden: int, bias: bool
    ) -> None:
        for name, q, out, n in (("w13", self.w13, 2 * intermediate, hidden),
                                ("w2", self.w2, hidden, intermediate)):
            codes = q.codes_shape(out, n)
            scales = (num_experts, *q.scales_shape(out, n))
            codes_dtype = torch.float8_e4m3fn if q.is_fp8 else torch.uint8
            setattr(layer, f"{name}_codes",
                    _frozen(torch.empty(num_experts, *codes, dtype=codes_dtype)))
            setattr(layer, f"{name}_scales", _frozen(torch.empty(scales, dtype=torch.float32)))
            setattr(layer, f"{name}_offsets",
                    _frozen(torch.empty(scales, dtype=torch.float32))
                    if q.zero_points and not q.is_fp8 else None)
        e, i, h = num_experts, intermediate, hidden
        layer.w13_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=self.dtype)) if bias else None
        layer.w2_bias = nn.Parameter(torch.empty(e, h, dtype=self.dtype)) if bias else None

    def weights(self, layer: nn.Module, expert: int) -> tuple[QuantizedWeight, QuantizedWeight]:
        """Expert `expert`'s (w13, w2) as the ops take them (views of the stacks)."""
        i, h = layer.local_intermediate, layer.w2_codes.shape[1]
        made = []
        for name, q, out, n in (("w13", self.w13, 2 * i, h), ("w2", self.w2, h, i)):
            offsets = getattr(layer, f"{name}_offsets")
            made.append(QuantizedWeight(q, getattr(layer, f"{name}_codes")[expert],
                                        getattr(layer, f"{name}_scales")[expert],
                                        None if offsets is None else offsets[expert], n, out))
        return made[0], made[1]

    def _linears(
        self, layer: nn.Module, prepack: Callable[[QuantizedWeight, None], Callable]
    ) -> Linears:
        return [tuple(prepack(w, None) for w in self.weights(layer, e))
                for e in range(layer.w13_codes.shape[0])]

    def apply_experts(
        self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
        with_down_bias: bool,
    ) -> torch.Tensor:
        linears = self._linears(layer, prepack_quantized_linear)
        return run_experts(layer, linears, x, weights, ids, with_down_bias)

    def prepack_experts(self, layer: nn.Module, ops: Ops) -> PackedExperts:
        return PackedExperts(layer, self._linears(layer, ops.prepack_quantized_linear))


@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """`apply_experts` of a `QuantizedExperts` layer over its experts' projections as the
    platform prepacked them (`linears[e]`: expert e's gate/up and down)."""

    layer: nn.Module
    linears: Linears

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 with_down_bias: bool) -> torch.Tensor:
        return run_experts(self.layer, self.linears, x, weights, ids, with_down_bias)


def run_experts(
    layer: nn.Module, linears: Linears, x: torch.Tensor, weights: torch.Tensor,
    ids: torch.Tensor, with_down_bias: bool,
) -> torch.Tensor:
    """The op `moe_experts`'s sum for a `FusedMoE` (`layer`: its activation and biases)
    whose expert e multiplies by `linears[e]` (gate/up, down) instead of stacked dense
    weights: each picked expert on its tokens, weighted, summed in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = ids.flatten()
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])
    flat_weights = weights.flatten().float()
    for e in torch.unique(flat_ids).tolist():
        if not 0 <= e < len(linears):
            raise ValueError(f"expert ids hold expert {e}; the layer has {len(linears)} experts")
        picks = (flat_ids == e).nonzero()[:, 0]
        tokens = token_of[picks]
        gate_up, down = linears[e]
        h = gate_up(x[tokens])
        if layer.w13_bias is not None:
            h = h + layer.w13_bias[e]
        y = down(moe_activation(h, layer.activation, layer.swiglu_alpha, layer.swiglu_limit))
        if with_down_bias and layer.w2_bias is not None:
            y = y + layer.w2_bias[e]
        out.index_add_(0, tokens, y.float() * flat_weights[picks, None])
    return out.to(x.dtype)


def module_plan(
    weight_schemes: Mapping[str, QuantScheme], weight_names: Iterable[str],
    map_name: Callable[[str], tuple[str, int | None]],
) -> dict[str, QuantScheme]:
    """Module name -> scheme for the layers to build quantized, from the checkpoint's
    quantized weights (`weight_schemes`: HF name -> scheme) among all its weight names.
    A fused module (q/k/v, gate/up; `map_name` is the model's HF name -> (parameter,
    shard)) is quantized only when every part is, in one scheme; otherwise it is built
    dense and its quantized parts dequantized (logged). A `FusedMoE`'s routed experts
    plan as `<moe>.w13` (every expert's gate and up) and `<moe>.w2` (every down)."""
    parts: dict[str, list[QuantScheme | None]] = {}
    for hf_name in weight_names:
        if not hf_name.endswith(".weight"):
            continue
        name, _ = map_name(hf_name)
        parts.setdefault(name.removesuffix(".weight"), []).append(weight_schemes.get(hf_name))
    plan = {}
    for module, schemes in parts.items():
        kinds = set(schemes)
        if len(kinds) == 1 and None not in kinds:
            plan[module] = schemes[0]
        elif kinds - {None}:
            logger.info("%s: parts quantized as %s: built dense (dequantized)", module,
                        sorted(s.format if s else "none" for s in kinds))
    return plan


def scheme_chooser(plan: Mapping[str, QuantScheme], dtype: torch.dtype) -> SchemeChooser:
    """`schemes(prefix)` for `LayerBuilder`: the layers `plan` names (module name ->
    scheme) quantized, every other one dense in `dtype`. A `FusedMoE` at `prefix` whose
    plan holds both `prefix.w13` and `prefix.w2` (its experts' projections) gets
    `QuantizedExperts`; with one of them only, dense experts (the other dequantized)."""
    dense = DenseWeights(dtype)
    built: dict[str, WeightScheme] = {}
    for name, quant in plan.items():
        moe, _, proj = name.rpartition(".")
        if proj in ("w13", "w2") and f"{moe}.w13" in plan and f"{moe}.w2" in plan:
            built[moe] = QuantizedExperts(plan[f"{moe}.w13"], plan[f"{moe}.w2"], dtype)
            continue
        built[name] = QuantizedWeights(quant, dtype)

    def choose(prefix: str) -> WeightScheme:
        return built.get(prefix, dense)

    return choose
