"""The CPU plugin's Mamba2 fast path against the core's reference (tokenmill.platforms.ops.mamba2)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.platforms.ops.mamba2 import Mamba2Dims, Mamba2Weights, mamba2_mixer
from tokenmill_cpu import kernels
from tokenmill_cpu.mamba2 import decode_step

DIMS = Mamba2Dims(num_heads=4, head_dim=8, num_groups=2, state_size=16, conv_kernel=4,
                  chunk_size=8)


def _weights(dtype: torch.dtype, gen: torch.Generator) -> Mamba2Weights:
    c, h = DIMS.conv_dim, DIMS.num_heads
    return Mamba2Weights(
        conv_weight=torch.randn(c, DIMS.conv_kernel, generator=gen).to(dtype),
        conv_bias=torch.randn(c, generator=gen).to(dtype),
        dt_bias=torch.randn(h, generator=gen).to(dtype),
        A=-torch.rand(h, generator=gen) - 0.2,
        D=torch.randn(h, generator=gen).to(dtype),
    )


def test_the_kernel_is_built():
    """The fast path must run here (g++ and ninja are in the environment)."""
    assert kernels.load() is not None
    assert hasattr(kernels.load(), "mamba2_state_update")


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_matches_the_reference(dtype, use_kernel):
    gen = torch.Generator().manual_seed(0)
    s = 5
    weights = _weights(dtype, gen)
    xbc = torch.randn(s, DIMS.conv_dim, generator=gen).to(dtype)
    dt = torch.randn(s, DIMS.num_heads, generator=gen).to(dtype)
    conv = torch.randn(s, *DIMS.conv_state_shape(), generator=gen).to(dtype)
    ssm = torch.randn(s, *DIMS.ssm_state_shape(), generator=gen)
    want, results = mamba2_mixer(xbc, dt, [1] * s, list(conv), list(ssm), weights, DIMS)
    got, got_conv, got_ssm = decode_step(xbc, dt, conv, ssm.clone(), weights, DIMS, use_kernel)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_conv, torch.stack([r.conv_state for r in results]))
    torch.testing.assert_close(got_ssm, torch.stack([r.ssm_state for r in results]), **tol)
