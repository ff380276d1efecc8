"""The nvidia plugin with a deliberately broken Triton attention kernel: T1 must refuse it.

Registered in-process (`tokenmill-conformance --platform broken-triton --plugin
<this file>:plugin`, with TRITON_INTERPRET=1 on a machine without a GPU). Every hook is
the nvidia plugin's (a `GpuPlugin` subclass built from its parts) except the attention
backends, whose kernel has the classic off-by-one of a causal
bound: each query also sees the slot after its own position. For a sequence's last token
that slot is the unwritten tail of its last partial block (or, on a block boundary,
whatever the padded block table points at), so the result is wrong, or NaN where the
suite poisons unwritten slots.
"""

from __future__ import annotations

import dataclasses

import pluggy
import torch
import triton
import triton.language as tl

from tokenmill.platforms.interfaces import AttentionBackend, AttentionKind, Platform
from tokenmill_nvidia.plugin import plugin as nvidia
from tokenmill_triton.attention import TritonPagedAttention, write_kv
from tokenmill_triton.platform_kit import GpuPlugin

hookimpl = pluggy.HookimplMarker("tokenmill")


@triton.jit
def _off_by_one_attention(
    q_ptr, out_ptr, cache_ptr, table_ptr, seq_lens_ptr, token_seq_ptr, token_pos_ptr, scale,
    stride_qt, stride_qh, stride_kv, stride_block, stride_slot, stride_head, stride_table,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD: tl.constexpr, TILE: tl.constexpr,
):
    """One program per (token, query head), keys in tiles of TILE, online softmax."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(token_seq_ptr + token)
    q_pos = tl.load(token_pos_ptr + token)
    dims = tl.arange(0, HEAD)
    q = tl.load(q_ptr + token * stride_qt + head * stride_qh + dims).to(tl.float32)
    kv_head = head // GROUP
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([HEAD], dtype=tl.float32)
    for start in range(0, q_pos + 2, TILE):
        k_pos = start + tl.arange(0, TILE)
        visible = k_pos < q_pos + 2  # BUG: should be q_pos + 1 (keys up to and including q_pos)
        page = tl.load(table_ptr + seq * stride_table + k_pos // BLOCK_SIZE, mask=visible,
                       other=0)
        offsets = page * stride_block + (k_pos % BLOCK_SIZE) * stride_slot + kv_head * stride_head
        k = tl.load(cache_ptr + offsets[:, None] + dims[None, :], mask=visible[:, None],
                    other=0.0).to(tl.float32)
        v = tl.load(cache_ptr + stride_kv + offsets[:, None] + dims[None, :],
                    mask=visible[:, None], other=0.0).to(tl.float32)
        scores = tl.where(visible, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        new_m = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - new_m)
        alpha = tl.exp(m - new_m)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = new_m
    tl.store(out_ptr + token * stride_qt + head * stride_qh + dims,
             (acc / total).to(out_ptr.dtype.element_ty))


class OffByOneAttention(TritonPagedAttention):
    def forward(self, spec, query, key, value, kv_cache, metadata):
        write_kv(key, value, kv_cache, metadata.slot_mapping, self.configs)
        q_lens = torch.tensor(metadata.query_lens_cpu)
        token_seq = torch.repeat_interleave(torch.arange(metadata.num_seqs), q_lens)
        first = torch.tensor(metadata.seq_lens_cpu) - q_lens
        starts = q_lens.cumsum(0) - q_lens
        token_pos = torch.arange(int(q_lens.sum())) - starts[token_seq] + first[token_seq]
        out = torch.empty_like(query)
        scale = spec.scale if spec.scale is not None else spec.head_size**-0.5
        _off_by_one_attention[(query.shape[0], query.shape[1])](
            query, out, kv_cache, metadata.block_tables, metadata.seq_lens,
            token_seq.to(query.device), token_pos.to(query.device), scale,
            query.stride(0), query.stride(1), *kv_cache.stride()[:4],
            metadata.block_tables.stride(0),
            GROUP=spec.num_heads // spec.num_kv_heads, BLOCK_SIZE=kv_cache.shape[2],
            HEAD=spec.head_size, TILE=16,
        )
        return out


class BrokenTritonPlugin(GpuPlugin):
    """The nvidia plugin with the off-by-one kernel for FULL and SLIDING_WINDOW."""

    @hookimpl
    def tokenmill_attention_backends(self, platform: Platform) -> list[AttentionBackend]:
        from tokenmill_nvidia.configs import INTERPRETER
        from tokenmill_triton.linear_attention import TritonLinearAttention
        from tokenmill_triton.mla import TritonMLAAttention

        # the broken paged kernel for the kinds it serves; the plugin's own LINEAR and MLA
        # backends for the other declared kinds (T0 checks every declared kind has one)
        return [OffByOneAttention(kind, INTERPRETER, "broken")
                for kind in (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW)] + [
            TritonLinearAttention(INTERPRETER, "broken"),
            TritonMLAAttention(INTERPRETER, "broken")]


plugin = BrokenTritonPlugin(**{f.name: getattr(nvidia, f.name) for f in dataclasses.fields(nvidia)})
