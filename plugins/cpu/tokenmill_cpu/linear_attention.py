"""The CPU plugin's recurrent (LINEAR) backend: Gated DeltaNet with decode batched.

The core's reference (`tokenmill.platforms.ops.linear_attention.ReferenceLinearAttentionBackend`)
runs every sequence alone: a state gather, the conv, the delta rule and a state scatter
per sequence and layer. Decode rows (one token each) are most of a serving step, so this
backend takes all of them at once: one gather of their states, the conv and one step of
the recurrence vectorized over the batch (einsum over [B, H, dk, dv]), one scatter back
(and one more for the rows whose token ends at a checkpoint). Prefill rows (and every
variant but gated_delta) go through the reference's per-sequence path, whose chunked
scan is already a sequence of matmuls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.platforms.interfaces import AttentionMetadata, AttentionSpec
from tokenmill.platforms.kit.kv_state import read_states, write_states
from tokenmill.platforms.ops.linear_attention import (
    GatedDeltaInputs,
    ReferenceLinearAttentionBackend,
    split_qkv,
)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_decode(
    inputs: GatedDeltaInputs, rows: torch.Tensor, conv_state: torch.Tensor, ssm: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: `rows` [B] index their tokens in `inputs`;
    conv_state [B, C, K - 1], ssm float32 [B, Hv, dk, dv] (not modified). Returns (out
    [B, Hv, dv] in the inputs' dtype, new conv_state, new ssm)."""
    x = inputs.mixed_qkv[rows]  # [B, C]
    window = torch.cat((conv_state.to(x.dtype), x[:, :, None]), dim=-1)  # [B, C, K]
    y = (window.to(inputs.conv_weight.dtype) * inputs.conv_weight[None]).sum(-1)
    if inputs.conv_bias is not None:
        y = y + inputs.conv_bias
    q, k, v = split_qkv(F.silu(y).to(x.dtype), inputs)
    rep = inputs.num_v_heads // inputs.num_k_heads
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = _l2norm(q.float()), _l2norm(k.float()), v.float()
    q = q * q.shape[-1] ** -0.5
    g, beta = inputs.g[rows].float(), inputs.beta[rows].float()  # [B, Hv]
    ssm = ssm * g.exp()[:, :, None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", ssm, k)
    delta = (v - predicted) * beta[:, :, None]
    ssm = ssm + k[:, :, :, None] * delta[:, :, None, :]
    out = torch.einsum("bhkv,bhk->bhv", ssm, q)
    return out.to(inputs.mixed_qkv.dtype), window[:, :, 1:], ssm


class CpuLinearAttention(ReferenceLinearAttentionBackend):
    """Gated DeltaNet (and the reference's other variants), decode rows batched."""

    name = "cpu_linear"

    def forward(  # type: ignore[override]
        self,
        spec: AttentionSpec,
        inputs: Any,
        state_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if spec.state.variant != "gated_delta":
            return super().forward(spec, inputs, state_cache, metadata)
        rec = metadata.recurrent
        starts = metadata.query_start_loc.tolist()
        decode = [i for i, n in enumerate(metadata.query_lens_cpu) if n == 1]
        out = torch.empty(
            metadata.num_tokens, inputs.num_v_heads, inputs.head_v_dim,
            dtype=inputs.mixed_qkv.dtype, device=inputs.mixed_qkv.device,
        )
        for i in range(metadata.num_seqs):
            if metadata.query_lens_cpu[i] != 1:
                lo, hi = starts[i], starts[i + 1]
                out[lo:hi] = self.forward_sequence(spec, inputs, state_cache, metadata, i, lo, hi)
        if decode:
            self._decode(spec, inputs, state_cache, rec, decode, starts, out)
        return out

    def _decode(self, spec, inputs, cache, rec, decode, starts, out) -> None:
        # a fresh sequence (token 0) reads its own slot and zeroes the rows after
        sources = [rec.source_block_ids[i] or rec.state_block_ids[i] for i in decode]
        conv_state, ssm = read_states(cache, spec.state, sources)
        fresh = torch.tensor([rec.source_block_ids[i] is None for i in decode])
        if fresh.any():
            conv_state[fresh], ssm[fresh] = 0, 0
        rows = torch.tensor([starts[i] for i in decode], device=out.device)
        result, conv_state, ssm = gated_delta_decode(inputs, rows, conv_state, ssm)
        out[rows] = result
        write_states(cache, spec.state, [rec.state_block_ids[i] for i in decode], [conv_state, ssm])
        # a decode token that completes a block may end at a checkpoint (n == 1)
        marks = [(j, pages) for j, i in enumerate(decode) for _, pages in rec.checkpoints[i]]
        if marks:
            picked = torch.tensor([j for j, _ in marks])
            write_states(cache, spec.state, [p for _, p in marks],
                         [conv_state[picked], ssm[picked]])
