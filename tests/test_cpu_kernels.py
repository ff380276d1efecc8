"""The CPU plugin's fused C++ kernels against the core's reference ops and ATen.

The attention kernel is covered with the rest of the CPU attention in test_cpu_plugin.py;
here: the element-wise ops, the small-batch bf16 GEMV, and the fallback when the kernels
are off.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tokenmill.platforms.ops import reference
from tokenmill_cpu import kernels, ops

# The kernels must build wherever the tests run (g++ and ninja are test requirements);
# TOKENMILL_CPU_KERNELS=0 skips these tests for a run of the ATen fallback alone.
pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="TOKENMILL_CPU_KERNELS=0")


def test_the_kernels_build_and_load_in_a_fresh_process(tmp_path):
    assert kernels.load() is not None, "the C++ kernels did not build: see the logged cause"
    # a second process imports the cached build without rebuilding it
    code = (
        "import time, torch; from tokenmill_cpu import kernels; t = time.perf_counter(); "
        "k = kernels.load(); assert k is not None; print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) < 5.0

DTYPES = [torch.float32, torch.bfloat16]
# bf16: bit-identical (the kernels round where the references round); float32: the compiler
# may fuse a multiply and an add (one rounding fewer).
EXACT = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=0, rtol=0)}


@pytest.fixture(scope="module")
def fused():
    return ops.kernel_ops()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 576), (7, 96), (3, 2, 100)])
def test_norms_match_the_reference(fused, dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(shape, generator=gen).to(dtype) * 3 for _ in range(2))
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    torch.testing.assert_close(
        fused["rms_norm"](x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), **EXACT[dtype]
    )
    x_before, residual_before = x.clone(), residual.clone()
    out, summed = fused["fused_add_rms_norm"](x, residual, weight, 1e-5)
    ref_out, ref_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, ref_summed, **EXACT[dtype])
    torch.testing.assert_close(out, ref_out, **EXACT[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size, rotary_dim", [(64, 64), (80, 40)])
def test_rotary_matches_aten_on_strided_views(fused, dtype, head_size, rotary_dim):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads = 5, 6, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
    query = qkv[:, : heads * head_size].view(tokens, heads, head_size)  # strided, as the model
    key = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, -1)
    positions = torch.tensor([0, 3, 17, 4095, 9])
    cache = torch.randn(4096, rotary_dim, generator=gen)
    q, k = fused["rotary_embedding"](positions, query, key, cache)
    ref_q, ref_k = ops.rotary_embedding(positions, query, key, cache)  # rounds as transformers
    torch.testing.assert_close(q, ref_q, **EXACT[dtype])
    torch.testing.assert_close(k, ref_k, **EXACT[dtype])
    core_q, _ = reference.rotary_embedding(positions, query, key, cache)  # one rounding
    torch.testing.assert_close(
        q, core_q, **({} if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2))
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_the_reference(fused, dtype):
    x = torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(2)).to(dtype) * 4
    torch.testing.assert_close(fused["silu_and_mul"](x), reference.silu_and_mul(x), **EXACT[dtype])


@pytest.mark.skipif(
    kernels.load() is None or not kernels.load().has_bf16_dot(), reason="no AVX512-BF16 CPU"
)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_bf16_linear_matches_float32_math(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=gen).bfloat16()
    b = torch.randn(960, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    apply = ops.prepack_linear(weight, b)  # GEMV kernel up to 4 rows, oneDNN above
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    got = apply(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 960)
    # float32 accumulation in another order, then one bf16 rounding of |y| ~ 24
    torch.testing.assert_close(got.float(), expected, atol=0.25, rtol=1e-2)


def test_kernels_off_falls_back_to_aten(monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    kernels.load.cache_clear()
    try:
        assert kernels.load() is None
        assert ops.kernel_ops() == {}
        weight, x = torch.randn(32, 64).bfloat16(), torch.randn(1, 64).bfloat16()
        expected = F.linear(x.float(), weight.float())
        torch.testing.assert_close(
            ops.prepack_linear(weight, None)(x).float(), expected, atol=0.1, rtol=1e-2
        )
    finally:
        monkeypatch.delenv("TOKENMILL_CPU_KERNELS")
        kernels.load.cache_clear()
    assert kernels.load() is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_matches_the_reference_on_strided_keys(dtype):
    gen = torch.Generator().manual_seed(3)
    tokens, kv_heads, head_size, block_size = 6, 2, 32, 8
    qkv = torch.randn(tokens, 4 * kv_heads * head_size, generator=gen).to(dtype)
    key = qkv[:, : kv_heads * head_size].view(tokens, kv_heads, head_size)
    value = qkv[:, 2 * kv_heads * head_size : 3 * kv_heads * head_size].view(tokens, kv_heads, -1)
    cache = torch.randn(2, 5, block_size, kv_heads, head_size, generator=gen).to(dtype)
    slots = torch.tensor([3, 17, 8, 39, 0, 21])
    expected = cache.clone()
    reference.write_kv(key, value, expected, slots)
    kernels.load().write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.load().write_kv(key, value, cache, torch.tensor([0, 1, 2, 3, 4, 40]))
