"""The CPU plugin's Mamba2 (linear-attention variant "mamba2") fast path.

The core's reference (`tokenmill.ops.mamba2.mamba2_mixer`) runs the convolution and the
scan sequence by sequence, a dozen small ATen calls each; in a decode step of S
sequences that is S times the per-op overhead for a few kilobytes of math. Here every
sequence decoding one token goes through one batched convolution update and one batched
state update (`decode_step`): the C++ kernel `mamba2_state_update` (one pass over the
states, csrc/kernels.cpp) when the kernels are built, else an in-place ATen update (two
passes; `tokenmill_cpu.kernels` logs why the build failed); prefill chunks
keep the reference's chunked scan (its matmuls already dominate). Same float32 math as
the reference, so the outputs agree to rounding (tests/test_mamba2_cpu.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.ops.mamba2 import Mamba2Dims, Mamba2Weights
from tokenmill_cpu import kernels


def decode_step(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    weights: Mamba2Weights,
    dims: Mamba2Dims,
    use_kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of each of S sequences: xbc [S, conv_dim], dt [S, H] raw, conv_states
    [S, conv_dim, K - 1], ssm_states [S, H, P, N] float32 (contiguous). Returns (y
    [S, H * P] in xbc's dtype, the new conv states in xbc's dtype, the new ssm states).

    Updates `ssm_states` in place and returns it as the new ssm states (the state is the
    big tensor: 2 passes over it, where an out-of-place update makes 4); the caller hands
    in states it read from the arena's pages, a copy. Does not modify its other inputs.
    `use_kernel=False` takes the ATen update even when the kernels are built."""
    num = xbc.shape[0]
    window = torch.cat((conv_states.to(xbc.dtype), xbc[:, :, None]), dim=-1)  # [S, C, K]
    # float32 accumulation rounded once to the weights' dtype, as F.conv1d does
    conved = (window.float() * weights.conv_weight.float()).sum(-1)
    if weights.conv_bias is not None:
        conved = conved + weights.conv_bias.float()
    conved = F.silu(conved.to(weights.conv_weight.dtype)).to(xbc.dtype)
    num_bc = dims.num_groups * dims.state_size
    x, B, C = conved.split([dims.intermediate_size, num_bc, num_bc], dim=-1)
    g, per = dims.num_groups, dims.num_heads // dims.num_groups
    step = F.softplus(dt.float() + weights.dt_bias.float()).clamp(*dims.dt_limit)  # [S, H]
    xf = x.float().view(num, g, per, dims.head_dim)
    if ssm_states.dtype != torch.float32 or not ssm_states.is_contiguous():
        raise ValueError(
            f"ssm_states must be contiguous float32, got {ssm_states.dtype} "
            f"(contiguous: {ssm_states.is_contiguous()})"
        )
    k = kernels.load() if use_kernel else None
    if k is not None:  # one pass over the state
        y = k.mamba2_state_update(
            ssm_states, xf.reshape(num, dims.num_heads, dims.head_dim).contiguous(),
            step.contiguous(), weights.A.float().contiguous(),
            B.float().reshape(num, g, dims.state_size).contiguous(),
            C.float().reshape(num, g, dims.state_size).contiguous(), weights.D.float().contiguous(),
        )
    else:  # heads grouped [S, G, H / G, P, N]: B and C broadcast over a group's heads
        decay = (step * weights.A.float()).exp().view(num, g, per, 1, 1)
        state = ssm_states.view(num, g, per, dims.head_dim, dims.state_size)
        Bg = B.float().view(num, g, 1, 1, dims.state_size)
        Cg = C.float().view(num, g, 1, dims.state_size, 1)
        state.mul_(decay).addcmul_((xf * step.view(num, g, per, 1))[..., None], Bg)
        y = (state @ Cg)[..., 0] + weights.D.float().view(1, g, per, 1) * xf
    return y.reshape(num, -1).to(xbc.dtype), window[:, :, 1:].contiguous(), ssm_states
