"""HF quantized checkpoints kept quantized (tokenmill.model.hf_quant): a tiny random llama
quantized and packed here in AWQ's, GPTQ's and FP8's safetensors layouts, loaded by
tokenmill's loader from its directory (format detected from config.json), logits against
transformers run on the same weights dequantized by the format's own formula, per group
size (per tensor and per 128x128 block for FP8).

The packers below are written from the formats as AutoAWQ (WQLinear_GEMM: `qweight`
[in, out / 8], nibble k of a word holding output column (0, 2, 4, 6, 1, 3, 5, 7)[k] of its
8; `qzeros` likewise; w = (q - z) s) and AutoGPTQ / GPTQModel (`qweight` [in / 8, out],
nibble k holding input row 8j + k; `qzeros` [in / group, out / 8] in order, storing
z - 1 in the "gptq" (v1) checkpoint format; `g_idx` = i // group) save them; FP8 as vLLM's
per-tensor checkpoints (`weight` float8_e4m3fn, `weight_scale` a float32 scalar, a static
`input_scale`) and DeepSeek-V3's (`weight_scale_inv` [ceil(out / 128), ceil(in / 128)],
`weight_block_size: [128, 128]`) store them, w = weight * scale of its block."""

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
from tokenmill.model.moe import FusedMoE
from tokenmill.model.quant import QuantizedExperts, QuantizedWeights
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
    assert all(isinstance(m._apply_packed, cpu_ops.Int4QuantizedLinear) for m in quantized)
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


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def _fp8_llama() -> LlamaForCausalLM:
    """Sizes that are not multiples of 128 (hidden 320, k/v 64 rows, intermediate 448), so
    the block scales have partial blocks at the edges."""
    config = LlamaConfig(hidden_size=320, intermediate_size=448, num_hidden_layers=2,
                         num_attention_heads=5, num_key_value_heads=1, vocab_size=256,
                         max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _fp8_quantize(weight: torch.Tensor, block: tuple[int, int] | None):
    """(float8_e4m3fn codes, float32 scales: [] per tensor, else one per block)."""
    out, n = weight.shape
    if block is None:
        scale = weight.abs().amax() / FP8_MAX
        return (weight / scale).to(torch.float8_e4m3fn), scale.float()
    r, c = block
    padded = torch.zeros(-(-out // r) * r, -(-n // c) * c)
    padded[:out, :n] = weight
    tiles = padded.reshape(padded.shape[0] // r, r, padded.shape[1] // c, c)
    scale = (tiles.abs().amax((1, 3)) / FP8_MAX).clamp(min=1e-12)
    full = scale.repeat_interleave(r, 0).repeat_interleave(c, 1)[:out, :n]
    return (weight / full).to(torch.float8_e4m3fn), scale.float()


def _fp8_checkpoint(tmp_path, block: tuple[int, int] | None):
    hf = _fp8_llama()
    tensors = {}
    for name, tensor in hf.state_dict().items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(LINEARS):
            tensors[name] = tensor.clone()
            continue
        codes, scale = _fp8_quantize(tensor, block)
        if block is None:
            dense = codes.float() * scale
            tensors[f"{prefix}.weight_scale"] = scale
            tensors[f"{prefix}.input_scale"] = torch.tensor(0.05)  # static activations
        else:
            r, c = block
            full = scale.repeat_interleave(r, 0).repeat_interleave(c, 1)
            dense = codes.float() * full[: tensor.shape[0], : tensor.shape[1]]
            tensors[f"{prefix}.weight_scale_inv"] = scale
        tensor.copy_(dense)
        tensors[name] = codes
    config = {"quant_method": "fp8", "activation_scheme": "static" if block is None
              else "dynamic"}
    if block is not None:
        config.update(fmt="e4m3", weight_block_size=list(block))
    hf.config.quantization_config = config
    hf.config.save_pretrained(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return hf


@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per_tensor", "block_128x128"])
def test_fp8_tiny_model_matches_transformers_on_the_dequantized_weights(tmp_path, block):
    hf = _fp8_checkpoint(tmp_path, block)
    detected, model = _load(tmp_path)
    assert detected == "fp8"
    quantized = [m for m in model.modules()
                 if isinstance(m, Linear) and isinstance(m.scheme, QuantizedWeights)]
    assert len(quantized) == 8
    assert all(m.weight_codes.dtype == torch.float8_e4m3fn for m in quantized)
    got, want = _logits(model, hf)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_fp8_scales_that_do_not_fit_are_refused(tmp_path):
    _fp8_checkpoint(tmp_path, (128, 128))
    config = AutoConfig.from_pretrained(str(tmp_path))
    config.quantization_config = {**config.quantization_config, "weight_block_size": [64, 64]}
    weights = checkpoint_weights(str(tmp_path), config, quantization="fp8")
    with pytest.raises(ValueError, match=r"down_proj: weight_scale_inv of shape \(3, 4\) does "
                                         r"not fit 320x448 weights in 64x64 blocks: expected "
                                         r"\(5, 7\)"):
        dict(weights)


@pytest.mark.parametrize("quantization", [None, "none"], ids=["unset", "none"])
def test_deepseek_v3_fp8_blocks_match_transformers(tmp_path, quantization, caplog):
    """DeepSeek-V3's own layout (a tiny one: MLA projections, dense and expert MLPs all in
    128x128-block FP8, one tensor per expert), against transformers on the same weights
    dequantized. Unset, the projections and the routed experts stay FP8, only kv_b_proj
    (MLA reads it as a tensor) is dequantized at load, logged; `none` dequantizes every
    weight."""
    from safetensors.torch import load_file
    from test_deepseek_v3 import tiny_config
    from transformers import AutoModelForCausalLM

    from tokenmill.platforms.ops.mla import ReferenceMLABackend

    config = tiny_config(300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    dense_dir, fp8_dir = tmp_path / "dense", tmp_path / "fp8"
    model.save_pretrained(dense_dir)
    dense, quantized = load_file(str(dense_dir / "model.safetensors")), {}
    for name, tensor in dense.items():
        if not (name.endswith("_proj.weight") or name.endswith("_mqa.weight")):
            quantized[name] = tensor
            continue
        codes, scale = _fp8_quantize(tensor, (128, 128))
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        dense[name] = codes.float() * full[: tensor.shape[0], : tensor.shape[1]]
        quantized[name], quantized[name.replace(".weight", ".weight_scale_inv")] = codes, scale
    assert sum(".experts." in n for n in quantized if n.endswith("_scale_inv")) == 2 * 8 * 3
    save_file(dense, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
                                        "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}
    model.config.save_pretrained(fp8_dir)
    save_file(quantized, str(fp8_dir / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    hf_config = AutoConfig.from_pretrained(str(fp8_dir))
    method = resolve_quantization(str(fp8_dir), hf_config, quantization)
    with caplog.at_level("INFO"):
        ours = build_model(
            hf_config, checkpoint_weights(str(fp8_dir), hf_config, quantization=method),
            dtype=torch.float32, device="cpu", ops=load_platform("cpu").ops,
            attention_backend=ReferenceMLABackend(), block_size=4,
            schemes=quant_schemes(str(fp8_dir), hf_config, method, torch.float32))
    kept = [m for m in ours.modules()
            if isinstance(m, Linear) and isinstance(m.scheme, QuantizedWeights)]
    logged = [r for r in caplog.records if "dequantized at load into layers built dense"
              in r.getMessage()]
    # unset: MLA's kv_b_proj (read as a tensor), one per layer
    count = 3 if quantization is None else 72
    assert len(logged) == 1 and f"{count} quantized checkpoint weights" in logged[0].getMessage()
    if quantization is None:
        assert method == "fp8" and len(kept) > 0 and logged[0].levelname == "WARNING"
        assert all(m.weight_codes.dtype == torch.float8_e4m3fn for m in kept)
        moes = [m for m in ours.modules() if isinstance(m, FusedMoE)]
        assert len(moes) == 2 and all(isinstance(m.scheme, QuantizedExperts) for m in moes)
        assert all(m.w13_codes.dtype == torch.float8_e4m3fn for m in moes)
    else:
        assert method == "none" and not kept and logged[0].levelname == "INFO"
    tokens = torch.randint(3, 300, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    harness = PagedHarness(ours, ReferenceMLABackend())
    seq = harness.add(tokens)
    got = harness.run([[(seq, 6)], [(seq, 5)]])[id(seq)]
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
