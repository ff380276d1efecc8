"""HF quantized checkpoints kept quantized (tokenmill.model.hf_quant): a tiny random llama
quantized and packed here in AWQ's and GPTQ's safetensors layouts, loaded by tokenmill's
loader from its directory (format detected from config.json), logits against transformers
run on the same weights dequantized by the format's own formula, per group size.

The packers below are written from the formats as AutoAWQ (WQLinear_GEMM: `qweight`
[in, out / 8], nibble k of a word holding output column (0, 2, 4, 6, 1, 3, 5, 7)[k] of its
8; `qzeros` likewise; w = (q - z) s) and AutoGPTQ / GPTQModel (`qweight` [in / 8, out],
nibble k holding input row 8j + k; `qzeros` [in / group, out / 8] in order, storing
z - 1 in the "gptq" (v1) checkpoint format; `g_idx` = i // group) save them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_harness import PagedHarness
from safetensors.torch import save_file
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from tokenmill.model.linear import Linear
from tokenmill.model.loader import (
    build_model,
    checkpoint_weights,
    quant_schemes,
    resolve_quantization,
)
from tokenmill.model.quant import QuantizedWeights
from tokenmill.platforms.ops.reference import ReferenceAttentionBackend
from tokenmill.platforms.registry import load_platform
from tokenmill_cpu import ops as cpu_ops

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _quantize(weight: torch.Tensor, group: int, min_zero: int):
    """Asymmetric 4-bit round to nearest per group of input columns: codes q [out, in],
    zero points z and float16 scales s [out, in / group], z >= min_zero."""
    out, n = weight.shape
    w = weight.reshape(out, n // group, group)
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-5).half()
    s = scales.float()
    zeros = (-lo / s).round().clamp(min_zero, 15)
    q = (w / s.unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, 15)
    return q.reshape(out, n).to(torch.int64), zeros.to(torch.int64), scales


def _pack_words(values: np.ndarray) -> np.ndarray:
    """[..., 8] 4-bit values -> int32 [...], value k in bits 4k..4k+3."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    words = (values.astype(np.uint32) << shifts).sum(-1).astype(np.uint32)
    return np.ascontiguousarray(words).view(np.int32)


def _pack_awq_columns(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] -> int32 [rows, cols / 8]: nibble k holds column AWQ_PACK_ORDER[k]."""
    rows, cols = values.shape
    grouped = values.numpy().reshape(rows, cols // 8, 8)[..., list(AWQ_PACK_ORDER)]
    return torch.from_numpy(_pack_words(grouped))


def _pack_awq(q, z, s):
    return {"qweight": _pack_awq_columns(q.T), "qzeros": _pack_awq_columns(z.T),
            "scales": s.T.contiguous()}


def _pack_gptq(q, z, s, group):
    n = q.shape[1]
    qweight = _pack_words(q.T.numpy().reshape(n // 8, 8, -1).transpose(0, 2, 1))
    zeros = (z - 1).T.numpy()  # the v1 ("gptq") format stores z - 1
    qzeros = _pack_words(zeros.reshape(zeros.shape[0], -1, 8))
    return {"qweight": torch.from_numpy(qweight), "qzeros": torch.from_numpy(qzeros),
            "scales": s.T.contiguous(),
            "g_idx": torch.arange(n, dtype=torch.int32) // group}


def _checkpoint(tmp_path, method: str, group: int, act_order: bool = False):
    """A directory holding `hf`'s weights quantized in `method`'s layout (lm_head and
    embeddings in float32, as both tools leave them); `hf` gets the same weights
    dequantized as w = (q - z) s."""
    hf = _tiny_llama()
    tensors = {}
    for name, tensor in hf.state_dict().items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(LINEARS):
            tensors[name] = tensor.clone()
            continue
        q, z, s = _quantize(tensor, group, min_zero=1 if method == "gptq" else 0)
        dense = (q - z.repeat_interleave(group, 1)).float() * s.float().repeat_interleave(group, 1)
        tensor.copy_(dense)
        parts = _pack_awq(q, z, s) if method == "awq" else _pack_gptq(q, z, s, group)
        if act_order:
            parts["g_idx"] = parts["g_idx"].flip(0)
        tensors.update({f"{prefix}.{part}": value for part, value in parts.items()})
    config = {"quant_method": method, "bits": 4, "group_size": group}
    config.update({"version": "gemm", "zero_point": True} if method == "awq" else
                  {"desc_act": act_order, "sym": False, "checkpoint_format": "gptq"})
    hf.config.quantization_config = config
    hf.config.save_pretrained(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return hf


def _load(path, quantization=None):
    config = AutoConfig.from_pretrained(str(path))
    method = resolve_quantization(str(path), config, quantization)
    return method, build_model(
        config, checkpoint_weights(str(path), config, quantization=method),
        dtype=torch.float32, device="cpu", ops=load_platform("cpu").ops,
        attention_backend=ReferenceAttentionBackend(), block_size=4,
        schemes=quant_schemes(str(path), config, method, torch.float32))


def _logits(model, hf):
    tokens = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    harness = PagedHarness(model, ReferenceAttentionBackend())
    seq = harness.add(tokens)
    got = harness.run([[(seq, 7)], [(seq, 5)]])[id(seq)]
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0]
    return got, want


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_tiny_model_matches_transformers_on_the_dequantized_weights(tmp_path, method, group):
    hf = _checkpoint(tmp_path, method, group)
    detected, model = _load(tmp_path)
    assert detected == method
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    quantized = [m for m in layers if isinstance(m.scheme, QuantizedWeights)]
    assert len(layers) == 9 and len(quantized) == 8  # the head stays dense
    assert {(m.scheme.quant.method, m.scheme.quant.group_size) for m in quantized} == {
        (method, group)}
    assert all(m.weight_codes.dtype == torch.uint8 for m in quantized)  # codes, not floats
    assert all(isinstance(m._apply_packed, cpu_ops.Int4PackedLinear) for m in quantized)
    got, want = _logits(model, hf)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_quantization_none_dequantizes_at_load(tmp_path, method):
    hf = _checkpoint(tmp_path, method, 64)
    detected, model = _load(tmp_path, "none")
    assert detected == "none"
    assert not any(isinstance(m.scheme, QuantizedWeights) for m in model.modules()
                   if isinstance(m, Linear))
    got, want = _logits(model, hf)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_what_is_not_read_is_refused_naming_it(tmp_path):
    _checkpoint(tmp_path, "gptq", 32, act_order=True)
    with pytest.raises(ValueError, match=r"_proj: g_idx is not i // group_size .*act-order"):
        _load(tmp_path)
    config = AutoConfig.from_pretrained(str(tmp_path))
    saved = dict(config.quantization_config)
    for field, value, message in (("bits", 8, "bits=8"), ("checkpoint_format", "marlin",
                                                          "'marlin' is not read")):
        config.quantization_config = {**saved, field: value}
        with pytest.raises(ValueError, match=message):
            quant_schemes(str(tmp_path), config, "gptq", torch.float32)
    config.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 32,
                                  "version": "gemv"}
    with pytest.raises(ValueError, match="AWQ checkpoint version 'gemv' is not read"):
        quant_schemes(str(tmp_path), config, "awq", torch.float32)
