"""HF quantized checkpoints kept quantized: AWQ and GPTQ int4 (the safetensors layouts
AutoAWQ, AutoGPTQ / GPTQModel and transformers save) and FP8 (per-tensor, and DeepSeek-V3's
block-wise) turned into the contract's codes / scales / offsets
(`tokenmill.platforms.ops.quant`) without a float copy of the matrix.

A quantized linear `<prefix>` is stored as int32-packed 4-bit codes and zero points with
float16 scales, one per group of `group_size` input columns (`quantization_config` in
config.json; -1: one group per row):

- AWQ (`version: "gemm"`): `qweight` int32 [in, out / 8] and `qzeros` int32
  [in / group, out / 8] pack 8 output columns per word, nibble k (bits 4k..4k+3) holding
  column `AWQ_ORDER[k]` of its 8; `scales` [in / group, out]; w = (q - z) * s.
- GPTQ: `qweight` int32 [in / 8, out] packs 8 input rows per word in order (nibble k is
  row 8j + k); `qzeros` int32 [in / group, out / 8] packs 8 output columns in order;
  `scales` [in / group, out]; `g_idx` int32 [in], each input's group. The "gptq"
  checkpoint format (v1) stores each zero point minus one: w = (q - (z + 1)) * s;
  "gptq_v2" stores z itself. Act-order checkpoints (`desc_act`, a `g_idx` other than
  i // group) put inputs of one group apart, which the contract's storage cannot hold:
  refused, naming the layer.

FP8 (`quant_method: "fp8"`) stores `weight` as float8_e4m3fn [out, in] with either
`weight_scale` (one float32 for the tensor, or one per output row) or, with
`weight_block_size: [r, c]` (DeepSeek-V3: 128 x 128), `weight_scale_inv` float32
[ceil(out / r), ceil(in / c)]: w = weight * scale of its block. The codes are kept; the
scales are stored one per row of each block (the contract's `fp8_block` (1, c), or
(1, in) per tensor), each row taking its block's scale: the same weights exactly, and
fused projections (q/k/v, gate/up) concatenate by rows whatever their sizes.
Activations stay in the compute dtype (weight-only): a static `input_scale` is dropped.

Each becomes `<prefix>.weight` as a `QuantizedCheckpointTensor` (codes [out, in], scales
and offsets -z * s [out, in / group]; FP8 without offsets); every other tensor passes
through unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tokenmill.model.quant import QuantizedCheckpointTensor
from tokenmill.platforms.ops.quant import QuantScheme

HF_QUANT_METHODS = ("awq", "gptq", "fp8")
# the output column (of its 8) that nibble k of an AWQ word holds
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
          "fp8": ("weight", "weight_scale"), "fp8_block": ("weight", "weight_scale_inv")}


def quantization_config(hf_config: Any) -> dict:
    """The config's `quantization_config` as a dict ({} when there is none)."""
    config = getattr(hf_config, "quantization_config", None) or {}
    return config if isinstance(config, dict) else config.to_dict()


@dataclasses.dataclass(frozen=True, slots=True)
class PackedFormat:
    """What `quantization_config` says of the packing: method, bits, group size (-1: one
    group per row), what is added to a stored zero point (1 for GPTQ v1), and FP8's
    scale block (rows, columns; None: per tensor)."""

    method: str
    bits: int
    group_size: int
    zero_shift: int
    block: tuple[int, int] | None = None

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensors of one quantized layer, by suffix."""
        return _PARTS["fp8_block" if self.block else self.method]

    @classmethod
    def from_config(cls, method: str, hf_config: Any) -> PackedFormat:
        """ValueError naming the field for what this reader does not take."""
        config = quantization_config(hf_config)
        if method == "fp8":
            return cls._fp8(config)
        bits, group = config.get("bits", config.get("w_bit")), config.get(
            "group_size", config.get("q_group_size"))
        if bits != 4:
            raise ValueError(f"{method} checkpoint with bits={bits!r}: only 4-bit {method} "
                             "is read")
        if not isinstance(group, int) or not (group > 0 or group == -1):
            raise ValueError(f"{method} checkpoint with group_size={group!r}: expected a "
                             "positive group size or -1 (one group per row)")
        if method == "awq":
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"AWQ checkpoint version {version!r} is not read; only "
                                 "'gemm' (AutoAWQ's default layout)")
            if config.get("zero_point", True) is not True:
                raise ValueError("AWQ checkpoint with zero_point=false is not read")
            return cls(method, 4, group, 0)
        if method != "gptq":
            raise ValueError(f"quantization method {method!r} is not one of {HF_QUANT_METHODS}")
        fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not read; only 'gptq' "
                             "and 'gptq_v2'")
        return cls(method, 4, group, 1 if fmt == "gptq" else 0)

    @classmethod
    def _fp8(cls, config: dict) -> PackedFormat:
        block = config.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) <= 0):
            raise ValueError(f"FP8 weight_block_size {block!r}: expected [rows, columns]")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 checkpoint fmt {fmt!r} is not read; only 'e4m3'")
        return cls("fp8", 8, 0, 0, None if block is None else (int(block[0]), int(block[1])))

    def scheme(self, in_features: int) -> QuantScheme:
        if self.method == "fp8":
            cols = in_features if self.block is None else self.block[1]
            return QuantScheme("fp8", "fp8_e4m3", bits=8, zero_points=False,
                               fp8_block=(1, cols))
        group = in_features if self.group_size == -1 else self.group_size
        return QuantScheme(self.method, "int4", bits=4, group_size=group)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., n, 8]: nibble k (bits 4k..4k+3) of each word."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _columns(packed: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [rows, cols / 8] packing 8 columns per word -> uint8 [rows, cols]; nibble k
    holds column order[k] of its 8 (in order when None)."""
    nibbles = _nibbles(packed)
    if order is not None:
        nibbles = nibbles[..., [order.index(c) for c in range(8)]]
    return nibbles.flatten(-2)


def awq_weight(name: str, scheme: QuantScheme, qweight: torch.Tensor, qzeros: torch.Tensor,
               scales: torch.Tensor) -> QuantizedCheckpointTensor:
    """AWQ's GEMM layout (module docstring) as the contract's storage."""
    codes = _columns(qweight, AWQ_ORDER).T  # [out, in]
    zeros = _columns(qzeros, AWQ_ORDER).T.float()
    return _kept(name, scheme, codes, zeros, scales)


def gptq_weight(name: str, scheme: QuantScheme, qweight: torch.Tensor, qzeros: torch.Tensor,
                scales: torch.Tensor, g_idx: torch.Tensor, zero_shift: int
                ) -> QuantizedCheckpointTensor:
    """GPTQ's layout (module docstring) as the contract's storage."""
    rows, out = qweight.shape
    codes = _nibbles(qweight.T).reshape(out, rows * 8)  # [out, in]: row 8j + k is nibble k
    in_features = rows * 8
    groups = torch.arange(in_features, dtype=torch.int64) // scheme.group_size
    if tuple(g_idx.shape) != (in_features,) or not torch.equal(g_idx.long(), groups):
        raise ValueError(
            f"{name}: g_idx is not i // group_size ({scheme.group_size}): an act-order "
            "(desc_act) GPTQ checkpoint, whose groups are not contiguous input columns, "
            "is not read yet; use a checkpoint quantized with desc_act=false")
    zeros = _columns(qzeros, None).T.float() + zero_shift
    return _kept(name, scheme, codes, zeros, scales)


def _kept(name: str, scheme: QuantScheme, codes: torch.Tensor, zeros: torch.Tensor,
          scales: torch.Tensor) -> QuantizedCheckpointTensor:
    out, in_features = codes.shape
    want = scheme.scales_shape(out, in_features)
    scales = scales.float().T.contiguous()
    if tuple(scales.shape) != want or tuple(zeros.shape) != want:
        raise ValueError(f"{name}: scales {tuple(scales.shape)} / zero points "
                         f"{tuple(zeros.shape)} (transposed) do not fit {out}x{in_features} "
                         f"weights in groups of {scheme.group_size}: expected {want}")
    return QuantizedCheckpointTensor(scheme, codes.contiguous(), scales,
                                     (-zeros * scales).contiguous())


def fp8_weight(name: str, scheme: QuantScheme, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None) -> QuantizedCheckpointTensor:
    """An FP8 weight and its scales (module docstring) as the contract's storage: the codes
    as they are, one scale per row of each block."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: FP8 weight of dtype {weight.dtype}; only "
                         "torch.float8_e4m3fn is read")
    out, in_features = weight.shape
    scale = scale.float()
    if block is None:
        if scale.numel() not in (1, out):
            raise ValueError(f"{name}: weight_scale of shape {tuple(scale.shape)} is neither "
                             f"per tensor nor per row ({out})")
        rows = scale.reshape(-1, 1).expand(out, 1)
    else:
        r, c = block
        want = (-(-out // r), -(-in_features // c))
        if tuple(scale.shape) != want:
            raise ValueError(f"{name}: weight_scale_inv of shape {tuple(scale.shape)} does "
                             f"not fit {out}x{in_features} weights in {r}x{c} blocks: "
                             f"expected {want}")
        rows = scale.repeat_interleave(r, 0)[:out]
    return QuantizedCheckpointTensor(scheme, weight, rows.contiguous(), None)


class HFQuantizedCheckpoint:
    """One HF directory's safetensors tensors by name, its AWQ / GPTQ layers folded into
    `<prefix>.weight` (see the module docstring)."""

    def __init__(self, files: list[Path], hf_config: Any, method: str) -> None:
        self.format = PackedFormat.from_config(method, hf_config)
        self.parts = self.format.parts
        self.files = files
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.file_of: dict[str, Path] = {}
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    self.file_of[name] = file
                    self.shapes[name] = tuple(f.get_slice(name).get_shape())
        marker = "." + self.parts[1 if method == "fp8" else 0]  # qweight, weight_scale(_inv)
        self.prefixes = sorted(n.removesuffix(marker) for n in self.file_of
                               if n.endswith(marker))
        if method == "fp8" and not self.prefixes:
            raise ValueError(f"FP8 checkpoint with weight_block_size={self.format.block}: no "
                             f"tensor ends in {marker}")
        for prefix in self.prefixes:
            missing = [p for p in self.parts if f"{prefix}.{p}" not in self.file_of]
            if missing:
                raise ValueError(f"{method} checkpoint: {prefix} has a {marker[1:]} but no "
                                 f"{missing}")

    def _in_features(self, prefix: str) -> int:
        if self.format.method == "fp8":
            return self.shapes[f"{prefix}.weight"][1]
        rows = self.shapes[f"{prefix}.qweight"][0]
        return rows if self.format.method == "awq" else rows * 8

    def schemes(self) -> dict[str, QuantScheme]:
        """HF weight name -> the scheme it is kept in (only the quantized ones)."""
        return {f"{p}.weight": self.format.scheme(self._in_features(p)) for p in self.prefixes}

    def names(self) -> list[str]:
        """Every tensor name the checkpoint yields (parts folded into `.weight`; FP8's
        activation scales dropped: activations stay in the compute dtype)."""
        folded = {f"{p}.{part}" for p in self.prefixes for part in self.parts}
        if self.format.method == "fp8":
            folded |= {n for n in self.file_of if n.endswith(".input_scale")}
        return [n for n in self.file_of if n not in folded] + [f"{p}.weight" for p in self.prefixes]

    def tensors(self, keep: Callable[[str], bool] | None = None
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedCheckpointTensor]]:
        """(HF name, value): quantized layers as QuantizedCheckpointTensor, the rest as
        stored; `keep`: only the names it accepts (others are not read)."""
        from safetensors import safe_open

        schemes = self.schemes()
        with contextlib.ExitStack() as stack:
            handles = {f: stack.enter_context(safe_open(str(f), framework="pt"))
                       for f in self.files}

            def read(name: str) -> torch.Tensor:
                return handles[self.file_of[name]].get_tensor(name)

            for name in self.names():
                if keep is not None and not keep(name):
                    continue
                if name not in schemes:
                    yield name, read(name)
                    continue
                prefix = name.removesuffix(".weight")
                parts = [read(f"{prefix}.{p}") for p in self.parts]
                if self.format.method == "fp8":
                    yield name, fp8_weight(prefix, schemes[name], *parts, self.format.block)
                elif self.format.method == "awq":
                    yield name, awq_weight(prefix, schemes[name], *parts)
                else:
                    yield name, gptq_weight(prefix, schemes[name], *parts,
                                            zero_shift=self.format.zero_shift)
