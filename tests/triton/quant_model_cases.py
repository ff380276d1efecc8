"""A quantized model on the nvidia and rocm plugins: its Q4_0 and Q8_0 layers run the
Triton GEMM (tokenmill_triton.quant), with no fallback warning, and each layer's output is
the core's reference's (quant_cases.py checks the fallback of the schemes the kernel does
not take). Run by test_triton_kernels.py in a fresh process (TRITON_INTERPRET=1
without a GPU, which the platforms' detection needs)."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf import GGMLQuantizationType, quantize
from transformers import LlamaConfig, LlamaForCausalLM

from tokenmill.model.gguf_quant import GGUF_SCHEMES, decode_blocks
from tokenmill.model.linear import Linear
from tokenmill.model.loader import build_model
from tokenmill.model.quant import QuantizedCheckpointTensor, scheme_chooser
from tokenmill.platforms.ops import quant
from tokenmill.platforms.ops.reference import ReferenceAttentionBackend
from tokenmill.platforms.registry import load_platform
from tokenmill_triton.configs import interpreter_mode
from tokenmill_triton.quant import TritonQuantizedLinear

DEVICE = "cpu" if interpreter_mode() else "cuda"
FUSED = (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj"),
         ("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj"))


def _checkpoint():
    """A tiny random llama: attention and head in Q4_0, the MLP in Q8_0 (gguf quantizes)."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                         max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    weights, plan = [], {}
    for name, tensor in LlamaForCausalLM(config).state_dict().items():
        if tensor.dim() != 2 or "embed" in name:
            weights.append((name, tensor))
            continue
        kind = "Q8_0" if "mlp" in name else "Q4_0"
        raw = quantize(tensor.numpy(), getattr(GGMLQuantizationType, kind))
        codes, scales, offsets = decode_blocks(kind, raw, tensor.shape[1])
        weights.append((name, QuantizedCheckpointTensor(
            GGUF_SCHEMES[kind], torch.from_numpy(codes.copy()),
            torch.from_numpy(scales.astype("float32")),
            torch.from_numpy(offsets.astype("float32")))))
        module = name.removesuffix(".weight")
        for part, fused in FUSED:
            module = module.replace(part, fused)
        plan[module] = GGUF_SCHEMES[kind]
    return config, weights, plan


@pytest.mark.parametrize("platform", ["nvidia", "rocm"])
def test_every_quantized_layer_runs_the_kernel(platform, caplog):
    active = load_platform(platform)
    config, weights, plan = _checkpoint()
    with caplog.at_level(logging.WARNING):
        model = build_model(config, weights, dtype=torch.float32, device=DEVICE, ops=active.ops,
                            attention_backend=ReferenceAttentionBackend(), block_size=4,
                            schemes=scheme_chooser(plan, torch.float32))
    named = [r.getMessage() for r in caplog.records
             if f"platform plugin '{platform}' has no quantized-linear kernel" in r.getMessage()]
    assert not named, caplog.text
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(layers) == 9 and all(isinstance(m._apply_packed, TritonQuantizedLinear)
                                    for m in layers)  # qkv, o, gate_up, down of 2; the head
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for layer in (m for m in layers if m.in_features == 64):
        want = quant.quantized_linear(x, layer.scheme.weight(layer), None)
        torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
