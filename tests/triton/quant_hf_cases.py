"""Quantized HF checkpoints end to end on the nvidia plugin: a tiny AWQ llama, a tiny FP8
(128 x 128 blocks) llama and a tiny AWQ Qwen3-MoE (experts kept quantized), written by
tests/test_hf_quantization.py's and tests/test_quantized_moe.py's packers, loaded by
tokenmill's loader onto the nvidia ops: every quantized linear and every expert's
projection on the Triton GEMM (tokenmill_triton.quant), no fallback warning, and the
logits against transformers run on the same weights dequantized. Run by
test_triton_kernels.py in a fresh process (TRITON_INTERPRET=1 without a GPU)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from transformers import AutoConfig

from tokenmill.model.linear import Linear
from tokenmill.model.loader import (
    build_model,
    checkpoint_weights,
    quant_schemes,
    resolve_quantization,
)
from tokenmill.model.moe import FusedMoE
from tokenmill.model.quant import PackedExperts, QuantizedWeights
from tokenmill.platforms.ops.reference import ReferenceAttentionBackend
from tokenmill.platforms.registry import load_platform
from tokenmill_triton.configs import interpreter_mode
from tokenmill_triton.quant import TritonQuantizedLinear

sys.path.insert(0, str(Path(__file__).parents[1]))  # the packers of tests/
from test_hf_quantization import _checkpoint, _fp8_checkpoint, _logits  # noqa: E402
from test_quantized_moe import _moe_checkpoint  # noqa: E402

DEVICE = "cpu" if interpreter_mode() else "cuda"


def _load_on_nvidia(path: Path):
    config = AutoConfig.from_pretrained(str(path))
    method = resolve_quantization(str(path), config, None)
    return method, build_model(
        config, checkpoint_weights(str(path), config, quantization=method),
        dtype=torch.float32, device=DEVICE, ops=load_platform("nvidia").ops,
        attention_backend=ReferenceAttentionBackend(), block_size=4,
        schemes=quant_schemes(str(path), config, method, torch.float32))


def _check(tmp_path, hf, method, caplog) -> list:
    with caplog.at_level(logging.WARNING):
        detected, model = _load_on_nvidia(tmp_path)
    assert detected == method
    assert not [r for r in caplog.records if "no quantized-linear kernel" in r.getMessage()]
    got, want = _logits(model, hf)
    torch.testing.assert_close(got.cpu(), want, atol=2e-4, rtol=0)
    return list(model.modules())


def test_awq_llama_runs_on_the_triton_gemm(tmp_path, caplog):
    hf = _checkpoint(tmp_path, "awq", 64)
    modules = _check(tmp_path, hf, "awq", caplog)
    quantized = [m for m in modules if isinstance(m, Linear) and isinstance(m.scheme, QuantizedWeights)]
    assert len(quantized) == 8 and all(isinstance(m._apply_packed, TritonQuantizedLinear)
                                       for m in quantized)


def test_fp8_block_llama_runs_on_the_triton_gemm(tmp_path, caplog):
    hf = _fp8_checkpoint(tmp_path, (128, 128))
    modules = _check(tmp_path, hf, "fp8", caplog)
    quantized = [m for m in modules if isinstance(m, Linear) and isinstance(m.scheme, QuantizedWeights)]
    assert quantized and all(isinstance(m._apply_packed, TritonQuantizedLinear) for m in quantized)


def test_awq_moe_experts_run_on_the_triton_gemm(tmp_path, caplog):
    hf = _moe_checkpoint(tmp_path, "qwen3_moe", "awq", 32)
    modules = _check(tmp_path, hf, "awq", caplog)
    moes = [m for m in modules if isinstance(m, FusedMoE)]
    assert moes and all(isinstance(m._apply_packed, PackedExperts) for m in moes)
    for moe in moes:
        linears = [f for pair in moe._apply_packed.linears for f in pair]
        assert linears and all(isinstance(f, TritonQuantizedLinear) for f in linears)
