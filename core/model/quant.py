"""Quantized weight schemes: a `WeightScheme` per layer, chosen through the model's one
construction point (`LayerBuilder`'s `schemes(prefix)`), no family touched.

A quantized layer holds the contract's storage (`tokenmill.platforms.ops.quant`) as
parameters named `weight_codes`, `weight_scales` and (with zero points) `weight_offsets`;
a checkpoint reader that keeps a weight quantized yields it as a
`QuantizedCheckpointTensor`, which `CausalLM.load_weights` copies part by part (fused
q/k/v and gate/up rows included: every part has one row per output feature) or, for a
layer built dense, dequantizes. The matmul is the platform's
`prepack_quantized_linear`, the reference's until prepacked.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping

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
        raise NotImplementedError(
            f"quantized MoE experts ({self.quant.format}) are not supported yet; serve the "
            "model with --quantization none (experts dequantized to --dtype)"
        )

    def apply_experts(self, layer, x, weights, ids, with_down_bias):  # pragma: no cover
        raise NotImplementedError("quantized MoE experts are not supported yet")


def module_plan(
    weight_schemes: Mapping[str, QuantScheme], weight_names: Iterable[str],
    map_name: Callable[[str], tuple[str, int | None]],
) -> dict[str, QuantScheme]:
    """Module name -> scheme for the layers to build quantized, from the checkpoint's
    quantized weights (`weight_schemes`: HF name -> scheme) among all its weight names.
    A fused module (q/k/v, gate/up; `map_name` is the model's HF name -> (parameter,
    shard)) is quantized only when every part is, in one scheme; otherwise it is built
    dense and its quantized parts dequantized (logged)."""
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
    scheme) quantized, every other one dense in `dtype`."""
    dense = DenseWeights(dtype)
    built = {prefix: QuantizedWeights(quant, dtype) for prefix, quant in plan.items()}

    def choose(prefix: str) -> WeightScheme:
        return built.get(prefix, dense)

    return choose
