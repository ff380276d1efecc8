"""GGUF weights kept quantized: the raw blocks of Q4_0, Q4_1, Q8_0, Q4_K and Q6_K
(read with the `gguf` package's reader) turned into the contract's codes / scales /
offsets (`tokenmill.platforms.ops.quant`) without a float copy of the matrix.

Names are transformers' GGUF mapping (the same HF names the dequantizing path yields),
and its tensor processor's row permutation (llama.cpp permutes q and k rows for its
rotary layout) is applied to the quantized rows: GGUF quantizes each row on its own, so
reordering rows reorders codes, scales and offsets alike. A tensor whose processor does
anything else (renames, splits) or whose type is not one of GGUF_SCHEMES is dequantized.

MoE experts: llama.cpp stacks each projection of a layer's experts in one 3-D tensor
(`blk.N.ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, [E, rows, columns] in torch
order), which transformers maps to its stacked `experts.gate_up_proj` / `down_proj`.
Of a kept type, each expert's rows become one per-expert weight
(`<layer>.experts.{e}.gate_proj.weight`, ...), the names the MoE families read
per expert, so they load into `QuantizedExperts` (core/model/quant.py).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenmill.model.quant import QuantizedCheckpointTensor
from tokenmill.platforms.ops.quant import QuantScheme

logger = logging.getLogger(__name__)

# llama.cpp's stacked experts: projection -> the per-expert HF projection name
_EXPERTS = re.compile(r"blk\.\d+\.ffn_(?P<proj>gate|up|down)_exps\.weight")

GGUF_SCHEMES: dict[str, QuantScheme] = {
    "Q4_0": QuantScheme("gguf", "Q4_0", bits=4, group_size=32),
    "Q4_1": QuantScheme("gguf", "Q4_1", bits=4, group_size=32),
    "Q8_0": QuantScheme("gguf", "Q8_0", bits=8, group_size=32),
    "Q4_K": QuantScheme("gguf", "Q4_K", bits=4, group_size=32),
    "Q6_K": QuantScheme("gguf", "Q6_K", bits=6, group_size=16),
}


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """ggml's nibble order: [n, width / 2] bytes -> [n, width] low nibbles then high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)[..., :width]


def decode_blocks(type_name: str, data: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """(codes uint8 [rows, n], scales float32 [rows, n / g], offsets float32 [rows, n / g])
    of a GGUF tensor's raw rows (`data` uint8 [rows, bytes per row], `n` weights a row)."""
    rows = data.shape[0]
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
        blocks = data.reshape(rows, n // 32, size)
        d = _f16(blocks[..., 0:2])[..., 0]
        if type_name == "Q8_0":
            codes = blocks[..., 2:] ^ np.uint8(0x80)  # signed q -> q + 128
            return codes.reshape(rows, n), d, -128.0 * d
        if type_name == "Q4_0":
            return _nibbles(blocks[..., 2:], 32).reshape(rows, n), d, -8.0 * d
        m = _f16(blocks[..., 2:4])[..., 0]
        return _nibbles(blocks[..., 4:], 32).reshape(rows, n), d, m
    if type_name == "Q4_K":
        from gguf.quants import Q4_K

        blocks = data.reshape(rows * (n // 256), 144)
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16])
        qs = blocks[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 64 weights: low nibbles, high
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(rows, n)
        scales = (d * sc.astype(np.float32)).reshape(rows, n // 32)
        offsets = -(dmin * mins.astype(np.float32)).reshape(rows, n // 32)
        return codes, scales, offsets
    if type_name == "Q6_K":
        blocks = data.reshape(rows * (n // 256), 210)
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sub = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        d = _f16(blocks[:, 208:210])
        low = np.stack([ql.reshape(-1, 2, 64) & 0x0F, ql.reshape(-1, 2, 64) >> 4], axis=2)
        high = qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        codes = low.reshape(-1, 2, 4, 32) | ((high & 0x03) << 4)
        scales = (d * sub).reshape(rows, n // 16)
        return codes.reshape(rows, n), scales, -32.0 * scales
    raise ValueError(f"GGUF type {type_name} is not kept quantized; known: {sorted(GGUF_SCHEMES)}")


class ParameterNames:
    """What transformers' GGUF name mapping reads of a model: its config and parameter names.

    The real (meta) model works too, but the mapping then rebuilds gguf's name table once per
    submodule, which costs ~6 s on a 30-layer model.
    """

    def __init__(self, config: Any, names: list[str]) -> None:
        self.config = config
        self._names = names

    def state_dict(self) -> dict[str, None]:
        return dict.fromkeys(self._names)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return iter(())


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    tensor: Any  # gguf.ReaderTensor
    hf_name: str
    rows: np.ndarray | None  # the processor's row order; None: the tensor is not kept quantized
    expert: int | None = None  # of a stacked experts tensor: the expert this entry is


class GGUFCheckpoint:
    """One GGUF file's tensors by HF name: which stay quantized, and their values."""

    def __init__(self, path: Path | str, hf_config: Any) -> None:
        from gguf import GGUFReader
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            read_field,
        )

        self.reader = GGUFReader(str(path))
        architecture = read_field(self.reader, "general.architecture")[0]
        self.processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(
            config=hf_config.to_dict())
        with torch.device("meta"):
            names = list(AutoModelForCausalLM.from_config(hf_config).state_dict())
        name_map = get_gguf_hf_weights_map(ParameterNames(hf_config, names), self.processor)
        self.entries: list[_Entry] = []
        for tensor in self.reader.tensors:
            if tensor.name not in name_map:
                self.entries.extend(self._expert_entries(tensor, name_map))
                continue
            self.entries.append(_Entry(tensor, name_map[tensor.name], self._row_order(tensor)))

    @staticmethod
    def _expert_entries(tensor: Any, name_map: dict[str, str]) -> list[_Entry]:
        """One entry per expert of a stacked experts tensor (transformers maps it without
        `.weight` to its stacked name): kept quantized when its type is, else dequantized
        (rows None); none for any other tensor."""
        match = _EXPERTS.fullmatch(tensor.name)
        stacked = name_map.get(tensor.name.removesuffix(".weight"))
        if match is None or stacked is None or len(tensor.shape) != 3:
            return []
        layer = stacked.rpartition(".experts.")[0]
        num_experts, rows = int(tensor.shape[2]), int(tensor.shape[1])
        kept = tensor.tensor_type.name in GGUF_SCHEMES
        return [_Entry(tensor, f"{layer}.experts.{e}.{match['proj']}_proj.weight",
                       np.arange(rows) if kept else None, e) for e in range(num_experts)]

    def _row_order(self, tensor: Any) -> np.ndarray | None:
        """The processor's row permutation of a 2-D tensor of a kept type, else None."""
        if tensor.tensor_type.name not in GGUF_SCHEMES or len(tensor.shape) != 2:
            return None
        rows = int(tensor.shape[1])
        index = np.arange(rows, dtype=np.float64).reshape(rows, 1)
        result = self.processor.process(weights=index, name=tensor.name, tensor_key_mapping={},
                                        parsed_parameters={"tensors": {}, "config": {}})
        if result.name != tensor.name or result.weights.shape != index.shape:
            return None
        return result.weights[:, 0].astype(np.int64)

    def schemes(self) -> dict[str, QuantScheme]:
        """HF weight name -> the scheme it is kept in (only the quantized ones)."""
        return {e.hf_name: GGUF_SCHEMES[e.tensor.tensor_type.name]
                for e in self.entries if e.rows is not None}

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantizedCheckpointTensor]]:
        """(HF name, value) of every mapped tensor: kept ones as QuantizedCheckpointTensor,
        the others dequantized to float32 as transformers does."""
        from gguf import dequantize as gguf_dequantize

        decoded: tuple[Any, tuple[np.ndarray, ...]] | None = None  # a stacked tensor's
        for e in self.entries:
            t = e.tensor
            if e.expert is not None and e.rows is None:  # an expert of another type
                if decoded is None or decoded[0] is not t:
                    decoded = (t, (gguf_dequantize(t.data, t.tensor_type),))
                yield e.hf_name, torch.from_numpy(np.array(decoded[1][0][e.expert]))
                continue
            if e.expert is not None:  # one expert's rows of a stacked experts tensor
                if decoded is None or decoded[0] is not t:
                    raw = np.asarray(t.data).reshape(-1, np.asarray(t.data).shape[-1])
                    decoded = (t, decode_blocks(t.tensor_type.name, raw, int(t.shape[0])))
                rows = slice(e.expert * len(e.rows), (e.expert + 1) * len(e.rows))
                codes, scales, offsets = (part[rows] for part in decoded[1])
                yield e.hf_name, QuantizedCheckpointTensor(
                    GGUF_SCHEMES[t.tensor_type.name],
                    torch.from_numpy(np.ascontiguousarray(codes)),
                    torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)),
                    torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.float32)))
                continue
            if e.rows is None:
                weights = gguf_dequantize(t.data, t.tensor_type)
                result = self.processor.process(weights=weights, name=t.name,
                                                tensor_key_mapping={},
                                                parsed_parameters={"tensors": {}, "config": {}})
                yield e.hf_name, torch.from_numpy(np.array(result.weights))
                continue
            codes, scales, offsets = decode_blocks(t.tensor_type.name, t.data, int(t.shape[0]))
            order = e.rows
            yield e.hf_name, QuantizedCheckpointTensor(
                GGUF_SCHEMES[t.tensor_type.name],
                torch.from_numpy(np.ascontiguousarray(codes[order])),
                torch.from_numpy(np.ascontiguousarray(scales[order], dtype=np.float32)),
                torch.from_numpy(np.ascontiguousarray(offsets[order], dtype=np.float32)),
            )
