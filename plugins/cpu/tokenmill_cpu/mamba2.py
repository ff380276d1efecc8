"""The CPU plugin's Mamba2 (linear-attention variant "mamba2") fast path.

The core's reference (`tokenmill.platforms.ops.mamba2.mamba2_mixer`) runs the convolution and the
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

from tokenmill.platforms.interfaces import (
    AttentionMetadata,
    AttentionSpec,
    LinearAttentionBackend,
    RecurrentStateMetadata,
    recurrent_metadata,
)
from tokenmill.platforms.kit.kv_state import read_states, write_states, zero_states
from tokenmill.platforms.ops.linear_attention import ReferenceLinearAttentionBackend
from tokenmill.platforms.ops.mamba2 import Mamba2, Mamba2Dims, Mamba2Inputs, Mamba2Weights
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


class CpuMamba2Attention(LinearAttentionBackend):
    """Linear attention, variant "mamba2": the step's single-token sequences in one
    `decode_step`, prefill pieces through the core's reference variant (whose chunked
    scan is matmuls already). Same contract as `ReferenceLinearAttentionBackend`."""

    name = "cpu_mamba2"
    variants = frozenset({"mamba2"})

    def __init__(self) -> None:
        self._reference = ReferenceLinearAttentionBackend({"mamba2": Mamba2()})

    def forward(  # type: ignore[override]
        self,
        spec: AttentionSpec,
        inputs: Mamba2Inputs,
        state_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        rec = metadata.recurrent
        query_lens = metadata.query_lens_cpu
        starts = metadata.query_start_loc.tolist()
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        if len(decode) == metadata.num_seqs:
            return _decode(spec, inputs, state_cache, rec, decode, starts)
        if not decode:
            return self._reference.forward(spec, inputs, state_cache, metadata)
        y = inputs.xbc.new_empty(metadata.num_tokens, inputs.dims.intermediate_size)
        rows = torch.tensor([starts[i] for i in decode])
        y[rows] = _decode(spec, inputs, state_cache, rec, decode, starts)
        rest = [i for i, n in enumerate(query_lens) if n != 1]
        rest_rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rest])
        sub = recurrent_metadata(
            [query_lens[i] for i in rest],
            [metadata.seq_lens_cpu[i] for i in rest],
            RecurrentStateMetadata(
                [rec.state_block_ids[i] for i in rest],
                [rec.source_block_ids[i] for i in rest],
                [rec.checkpoints[i] for i in rest],
            ),
            metadata.block_size,
        )
        y[rest_rows] = self._reference.forward(
            spec, Mamba2Inputs(inputs.xbc[rest_rows], inputs.dt[rest_rows], inputs.weights,
                               inputs.dims),
            state_cache, sub,
        )
        return y


def _decode(
    spec: AttentionSpec,
    inputs: Mamba2Inputs,
    state_cache: torch.Tensor,
    rec: RecurrentStateMetadata,
    seqs: list[int],
    starts: list[int],
) -> torch.Tensor:
    """`decode_step` for the single-token sequences `seqs`; writes their slots and any
    checkpoint they take (after one token: the same state). Returns their y rows."""
    device = inputs.xbc.device
    have = [j for j, i in enumerate(seqs) if rec.source_block_ids[i] is not None]
    sources = [rec.source_block_ids[seqs[j]] for j in have]
    if len(have) == len(seqs):  # the usual decode step: every state from its pages
        conv, ssm = read_states(state_cache, spec.state, sources)
    else:  # one-token prompts start from zeros
        conv, ssm = zero_states(spec.state, len(seqs), device)
        if have:
            conv[have], ssm[have] = read_states(state_cache, spec.state, sources)
    rows = torch.tensor([starts[i] for i in seqs], device=device)
    y, conv, ssm = decode_step(inputs.xbc[rows], inputs.dt[rows], conv, ssm, inputs.weights,
                               inputs.dims)
    targets = [(j, rec.state_block_ids[i]) for j, i in enumerate(seqs)]
    targets += [(j, pages) for j, i in enumerate(seqs) for _, pages in rec.checkpoints[i]]
    if len(targets) == len(seqs):
        write_states(state_cache, spec.state, [p for _, p in targets], [conv, ssm])
    else:
        which = torch.tensor([j for j, _ in targets], device=device)
        write_states(state_cache, spec.state, [p for _, p in targets], [conv[which], ssm[which]])
    return y
