"""Decode context parallel: one sequence's KV cache spread over the ranks of the `dcp`
group, token p on rank p % n, and attention merged from every rank's part.

The ranks of a dcp group hold the same weights and compute the same hidden states (the
group is a grid dimension beside tp, core/distributed/parallel_state.py); what they split
is the KV cache, the memory that grows with the context. The scheduler's blocks are
`block_size` tokens of the sequence; each rank's physical block holds the
block_size / n of them that are its own, so the scheduler's block table is every rank's
table: the token at position p lives on rank p % n in block table[p // block_size] at
offset (p // n) % (block_size / n), and a rank's tokens, in order, are one paged sequence
of physical block size block_size / n over that table.

Each layer's attention (`DecodeContextParallelAttention`, an AttentionBackend wrapping
the step): every rank writes its own tokens' keys and values, attends all the step's
queries to the keys it holds (`partial_attention`, with their log-sum-exp), the partial
outputs and log-sum-exps are all-gathered over the group, and every rank merges them
(`merge_attention_states`) into the attention over the whole context. Per layer and
token that moves n x (heads x head_size + heads) float32 values.

The attention runs on the core's own partial attention (plain torch), not the
platform's backend: backends return no log-sum-exp. Full attention layers only.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.distributed.parallel_state import GroupCoordinator
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
    token_positions,
)
from tokenmill.platforms.ops.attention_merge import merge_attention_states, partial_attention
from tokenmill.platforms.ops.reference import gather_kv, write_kv

logger = logging.getLogger(__name__)


def check_decode_context_parallel(specs: list[AttentionSpec], block_size: int, dcp: int) -> None:
    """ValueError naming what does not fit: block_size must split over the ranks, and
    every layer must be full attention without sinks."""
    if block_size % dcp:
        raise ValueError(
            f"decode_context_parallel_size={dcp} must divide block_size={block_size} (each "
            "rank holds block_size / dcp tokens of every block)"
        )
    bad = [i for i, s in enumerate(specs) if s.kind != AttentionKind.FULL or s.sinks]
    if bad:
        raise ValueError(
            f"decode_context_parallel_size={dcp} supports full attention layers without "
            f"sinks; layers {bad} are not"
        )


class DecodeContextParallelAttention(AttentionBackend):
    """Attention over a KV cache spread token by token over the `dcp` group (module
    docstring). `spec.block_size` is the physical one: the scheduler's / n."""

    name = "decode_context_parallel"
    kind = AttentionKind.FULL

    def __init__(self, dcp: GroupCoordinator) -> None:
        self.dcp = dcp

    def supports(self, spec: AttentionSpec) -> bool:
        return spec.kind == AttentionKind.FULL and not spec.sinks

    def forward(self, spec, query, key, value, kv_cache, metadata: AttentionMetadata, sinks=None):
        n, rank = self.dcp.world_size, self.dcp.rank_in_group
        seq_index, positions = token_positions(metadata.query_lens_cpu, metadata.seq_lens_cpu)
        seq_index, positions = seq_index.to(query.device), positions.to(query.device)
        mine = positions % n == rank
        local = positions[mine] // n
        slots = (
            metadata.block_tables[seq_index[mine], local // spec.block_size].long() * spec.block_size
            + local % spec.block_size
        )
        write_kv(key[mine], value[mine], kv_cache, slots)
        scale = spec.scale if spec.scale is not None else spec.head_size**-0.5
        group = spec.num_heads // spec.num_kv_heads
        out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        lse = torch.full(query.shape[:2], float("-inf"), device=query.device)
        starts = metadata.query_start_loc.tolist()
        for i in range(metadata.num_seqs):
            seq_len = metadata.seq_lens_cpu[i]
            num_local = max(0, -(-(seq_len - rank) // n))
            if num_local == 0:
                continue
            k, v = gather_kv(kv_cache, metadata.block_tables[i], num_local)
            key_positions = torch.arange(num_local, device=query.device) * n + rank
            rows = slice(starts[i], starts[i + 1])
            out[rows], lse[rows] = partial_attention(
                query[rows], k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                positions[rows], key_positions, scale,
            )
        comm = self.dcp.communicator
        outs = comm.all_gather(out.unsqueeze(0))
        lses = comm.all_gather(lse.unsqueeze(0))
        return merge_attention_states(outs, lses).to(query.dtype)
