"""The Triton weight-only quantized GEMM (tokenmill_triton.quant) against the core's
reference `quantized_linear`, per scheme it covers (GGUF Q4_0, Q4_1, Q4_K, Q6_K and Q8_0
from their raw blocks, AWQ and GPTQ int4 in groups of 32 / 64 / 128, FP8 e4m3 per tensor
and in 1 x 128 row blocks), at M = 1 and small odd shapes, in float32, float16 and bfloat16;
and the nvidia / rocm ops as the registry loads them: the fast path where it covers the
scheme, with no fallback warning, the reference logged once per scheme elsewhere.
Run by test_triton_quant.py in a fresh process with TRITON_INTERPRET=1 (no GPU here);
tiny shapes: seconds in all."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quantize

from tokenmill.model.gguf_quant import GGUF_SCHEMES, decode_blocks
from tokenmill.platforms.ops import quant
from tokenmill.platforms.registry import load_platform
from tokenmill_triton.configs import KernelConfigs, interpreter_mode
from tokenmill_triton.quant import TritonQuantizedLinear

DEVICE = "cpu" if interpreter_mode() else "cuda"
K_QUANTS = {"Q4_K": (144, [(0, 2), (2, 4)]), "Q6_K": (210, [(208, 210)])}  # block bytes, f16 d
# the interpreter's bf16 tl.dot is wrong: bf16 tiles upcast there, as the plugins do
CONFIGS = KernelConfigs(upcast_bf16_dot=interpreter_mode())
# the conformance suite's linear bounds (tokenmill_conformance.suite.t1.test_ops)
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4),
             torch.float16: dict(atol=1e-2, rtol=1e-2),
             torch.bfloat16: dict(atol=5e-2, rtol=3e-2)}
# (M, N, K, activations): decode, odd M and N, a ragged last tile of rows and columns;
# each scheme runs every shape, each in one dtype (the interpreter's time)
CASES = [(1, 48, 256, torch.bfloat16), (3, 37, 256, torch.float16), (19, 70, 256, torch.float32)]


def _device(weight: quant.QuantizedWeight) -> quant.QuantizedWeight:
    offsets = None if weight.offsets is None else weight.offsets.to(DEVICE)
    return quant.QuantizedWeight(weight.scheme, weight.codes.to(DEVICE), weight.scales.to(DEVICE),
                                 offsets, weight.in_features, weight.out_features)


def _gguf(type_name: str, n: int, k: int, seed: int) -> quant.QuantizedWeight:
    """A GGUF weight from its raw blocks (gguf quantizes Q4_0 / Q4_1 / Q8_0; the K-quants'
    blocks are random bytes with small float16 super-block scales), decoded by the
    loader's reader."""
    rng = np.random.default_rng(seed)
    if type_name in K_QUANTS:
        size, scale_bytes = K_QUANTS[type_name]
        raw = rng.integers(0, 256, (n * (k // 256), size), dtype=np.uint8)
        for lo, hi in scale_bytes:
            raw[:, lo:hi] = rng.uniform(2e-4, 1e-3, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
        raw = raw.reshape(n, -1)
    else:
        dense = rng.standard_normal((n, k)).astype(np.float32) * 0.1
        raw = quantize(dense, getattr(GGMLQuantizationType, type_name))
    codes, scales, offsets = decode_blocks(type_name, raw, k)
    codes = torch.from_numpy(np.ascontiguousarray(codes))
    scheme = GGUF_SCHEMES[type_name]
    return quant.QuantizedWeight(
        scheme, quant.pack_int4(codes) if scheme.bits == 4 else codes,
        torch.from_numpy(scales.astype(np.float32)), torch.from_numpy(offsets.astype(np.float32)),
        k, n)


def _zero_point_int4(method: str, group: int, n: int, k: int, seed: int) -> quant.QuantizedWeight:
    """AWQ / GPTQ int4 as their reader stores it: codes q, scales s, offsets -z s for an
    integer zero point z per group (tokenmill.model.hf_quant)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float()
    return quant.QuantizedWeight(quant.QuantScheme(method, "int4", 4, group), quant.pack_int4(codes),
                                 scales, -zeros * scales, k, n)


def _fp8(block_cols: int | None, n: int, k: int, seed: int) -> quant.QuantizedWeight:
    """FP8 e4m3 codes with one scale per row block of `block_cols` columns (None: per
    tensor, stored as one block per row as the reader stores it)."""
    g = torch.Generator().manual_seed(seed)
    cols = k if block_cols is None else block_cols
    codes = (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn)
    if block_cols is None:
        scales = torch.full((n, 1), 0.0123)
    else:
        scales = torch.rand(n, -(-k // cols), generator=g) * 0.01 + 1e-3
    scheme = quant.QuantScheme("fp8", "fp8_e4m3", 8, zero_points=False, fp8_block=(1, cols))
    return quant.QuantizedWeight(scheme, codes, scales, None, k, n)


def _check(weight: quant.QuantizedWeight, m: int, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, weight.in_features, generator=g).to(dtype)
    bias = torch.randn(weight.out_features, generator=g).to(dtype) if seed % 2 else None
    want = quant.quantized_linear(x, weight, bias)
    fast = TritonQuantizedLinear(_device(weight), None if bias is None else bias.to(DEVICE), CONFIGS)
    got = fast(x.to(DEVICE))
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"])
def test_gguf_matches_the_reference(type_name):
    for seed, (m, n, k, dtype) in enumerate(CASES):
        _check(_gguf(type_name, n, k, seed), m, dtype, seed)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_zero_point_int4_matches_the_reference(method, group):
    for seed, (m, n, k, dtype) in enumerate(CASES):
        _check(_zero_point_int4(method, group, n, k, seed), m, dtype, seed)


def test_one_group_per_row_and_symmetric_int4():
    """GPTQ's group_size -1 (one group spanning a row of 96, not a power of two) and
    int4 without offsets (symmetric, w = q s)."""
    _check(_zero_point_int4("gptq", 96, 21, 96, 3), 5, torch.float32, 1)
    sym = _zero_point_int4("gptq", 64, 21, 128, 4)
    scheme = quant.QuantScheme("gptq", "int4", 4, 64, zero_points=False)
    _check(quant.QuantizedWeight(scheme, sym.codes, sym.scales, None, 128, 21), 2, torch.float32, 2)


@pytest.mark.parametrize("block_cols", [None, 128], ids=["per_tensor", "1x128"])
def test_fp8_matches_the_reference(block_cols):
    # K = 320: a partial last block of 64 columns (DeepSeek-V3's 128-blocks at the edge);
    # K = 99 per tensor: no power of two divides it
    for seed, (m, n, k, dtype) in enumerate(CASES):
        k = 99 if block_cols is None and seed == 2 else 320
        _check(_fp8(block_cols, n, k, seed), m, dtype, seed)


def test_every_fp8_code_decodes_as_torch_casts_it():
    """All 254 finite e4m3fn codes (subnormals, both zeros, the largest, 448) through the
    kernel's bit decoding: W = codes (scale 1) against an identity x gives W.T exactly."""
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = torch.cat([finite, finite[:2]]).view(torch.float8_e4m3fn).reshape(16, 16)
    scheme = quant.QuantScheme("fp8", "fp8_e4m3", 8, zero_points=False, fp8_block=(1, 16))
    weight = quant.QuantizedWeight(scheme, codes, torch.ones(16, 1), None, 16, 16)
    got = TritonQuantizedLinear(_device(weight), None, CONFIGS)(torch.eye(16, device=DEVICE))
    assert torch.equal(got.cpu(), codes.float().T)


def _fallback_warnings(records, platform: str) -> list[str]:
    return [r.getMessage() for r in records if r.levelname == "WARNING"
            and f"platform plugin '{platform}' has no quantized-linear kernel" in r.getMessage()]


@pytest.mark.parametrize("platform", ["nvidia", "rocm"])
def test_the_plugins_run_covered_schemes_on_the_kernel_and_log_the_rest_once(platform, caplog):
    prepack = load_platform(platform).ops.prepack_quantized_linear
    covered = [_gguf(name, 24, 256, seed) for seed, name in enumerate(GGUF_SCHEMES)]
    covered += [_zero_point_int4("awq", 128, 24, 256, 5), _fp8(128, 24, 256, 6),
                _fp8(None, 24, 99, 7)]
    square = _fp8(128, 24, 256, 8)  # 128 x 128 blocks as such: the reader never stores them
    scheme = quant.QuantScheme("fp8", "fp8_e4m3", 8, zero_points=False, fp8_block=(128, 128))
    square = quant.QuantizedWeight(scheme, square.codes, square.scales[:1], None, 256, 24)
    group_8 = _zero_point_int4("gptq", 8, 24, 256, 9)  # no tl.dot-sized step fits a group of 8
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(8))
    with caplog.at_level(logging.WARNING):
        for weight in covered:
            layer = prepack(_device(weight), None)
            assert isinstance(layer, TritonQuantizedLinear), weight.scheme
        assert not _fallback_warnings(caplog.records, platform), caplog.text
        for _ in range(2):  # a second layer of the same scheme: logged already
            for weight in (square, group_8):
                layer = prepack(_device(weight), None)
                assert not isinstance(layer, TritonQuantizedLinear)
                torch.testing.assert_close(layer(x.to(DEVICE)).cpu(),
                                           quant.quantized_linear(x, weight, None), atol=0, rtol=0)
    named = _fallback_warnings(caplog.records, platform)
    assert len(named) == 2, named
    assert any("fp8 fp8_e4m3 weights (block (128, 128))" in m for m in named)
    assert any("gptq int4 weights (4 bits, group 8)" in m for m in named)


def test_bad_activations_are_refused_naming_the_value():
    layer = TritonQuantizedLinear(_device(_gguf("Q4_0", 8, 256, 0)), None, CONFIGS)
    with pytest.raises(ValueError, match="torch.float64"):
        layer(torch.zeros(1, 256, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="x has 128 features, the weight 256"):
        layer(torch.zeros(1, 128, device=DEVICE))
