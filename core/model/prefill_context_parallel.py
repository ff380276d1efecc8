"""Context parallel for prefill: the step's tokens split over the ranks of the `pcp` group.

The pcp ranks hold the same weights (a grid dimension beside tp). A step of T tokens, T
at least `MIN_TOKENS_PER_RANK` per rank, is cut into n contiguous slices of the flat
token order (a slice may cover parts of several sequences, or part of one long prompt);
each rank runs the whole model on its slice only, so the matmuls of a long prefill are
split n ways. Attention needs every earlier key: in each layer the ranks all-gather the
step's keys and values (`PrefillContextParallelAttention`), every rank writes all of them
into its KV cache (each rank keeps the whole KV, so decode needs nothing more), and the
platform's own backend attends the rank's queries with the step's metadata cut to the
slice (`slice_metadata`: a sequence whose new tokens [a, b) are on this rank is one of
b - a queries over a context of b). The final hidden states are all-gathered, so the
runner sees every token's, as without context parallel.

Steps of fewer tokens (decode) run whole on every rank. Per layer and split token this
moves n x 2 x kv_heads x head_size values (the all-gather of K and V) and, per split
step, n x ceil(T / n) x hidden for the final gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.distributed.parallel_state import GroupCoordinator
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
    kv_cache_shape,
)
from tokenmill.platforms.ops.reference import write_kv

MIN_TOKENS_PER_RANK = 2  # a step with fewer per rank runs whole everywhere
_STATE = "prefill_context_parallel"


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else F.pad(x, [0, 0] * (x.dim() - 1) + [0, rows - x.shape[0]])


def slice_metadata(full: AttentionMetadata, lo: int, hi: int, chunk: int) -> AttentionMetadata:
    """`full` cut to the flat tokens [lo, hi): each sequence keeps its new tokens within
    the range, as the last ones of a context ending at its last kept token; sequences with
    none are left out. The full step's slots ride along for the layers' KV write."""
    query_lens, seq_lens, tables = [], [], []
    start = 0
    for i in range(full.num_seqs):
        q_len, seq_len = full.query_lens_cpu[i], full.seq_lens_cpu[i]
        a, b = max(start, lo), min(start + q_len, hi)
        if a < b:
            query_lens.append(b - a)
            seq_lens.append(seq_len - (start + q_len - b))
            tables.append(full.block_tables[i].tolist())
        start += q_len
    local = AttentionMetadata.build(
        query_lens, seq_lens, tables, full.block_size, full.slot_mapping.device
    )
    local.backend_state[_STATE] = (full.slot_mapping, full.num_tokens, chunk)
    return local


def split_forward(model, pcp: GroupCoordinator, input_ids, positions, kv_caches, metadata,
                  backends: list[AttentionBackend]) -> torch.Tensor:
    """`model` (the `model.` body, called as model(ids, positions, caches, per-layer
    metadata)) on this rank's slice of the step; every token's hidden states back."""
    n, rank = pcp.world_size, pcp.rank_in_group
    num_tokens = input_ids.shape[0]
    chunk = -(-num_tokens // n)
    lo, hi = min(rank * chunk, num_tokens), min((rank + 1) * chunk, num_tokens)
    local_of: dict[int, AttentionMetadata] = {}
    for meta in metadata:
        if id(meta) not in local_of:
            local = slice_metadata(meta, lo, hi, chunk)
            for backend in backends:
                backend.prepare(local)
            local_of[id(meta)] = local
    hidden = model(input_ids[lo:hi], positions[lo:hi], kv_caches,
                   [local_of[id(m)] for m in metadata])
    return pcp.communicator.all_gather(_pad_rows(hidden, chunk))[:num_tokens]


def should_split(num_tokens: int, pcp: GroupCoordinator) -> bool:
    return pcp.world_size > 1 and num_tokens >= MIN_TOKENS_PER_RANK * pcp.world_size


class PrefillContextParallelAttention(AttentionBackend):
    """The platform's backend, with the step's keys and values all-gathered over the pcp
    group and written whole before it attends this rank's slice (module docstring)."""

    name = "prefill_context_parallel"

    def __init__(self, inner: AttentionBackend, pcp: GroupCoordinator) -> None:
        self.inner = inner
        self.pcp = pcp
        self.kind = inner.kind
        self.supports_sinks = inner.supports_sinks
        self.kv_cache_dtypes = inner.kv_cache_dtypes

    def supports(self, spec: AttentionSpec) -> bool:
        return self.inner.supports(spec)

    def prepare(self, metadata: AttentionMetadata) -> None:
        self.inner.prepare(metadata)

    def kv_cache_shape(self, spec: AttentionSpec, num_blocks: int) -> tuple[int, ...]:
        """The standard layout, which the gathered keys and values are written in;
        ValueError when the inner backend wants another (or the layer is not multi-head)."""
        shape = tuple(self.inner.kv_cache_shape(spec, num_blocks))
        if spec.kind not in (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW) or shape != (
            kv_cache_shape(spec, num_blocks)
        ):
            raise ValueError(
                f"prefill_context_parallel_size > 1 writes the standard multi-head KV layout; "
                f"{self.inner.name!r} declares {shape} for a {spec.kind.name} layer"
            )
        return shape

    def forward(self, spec, query, key, value, kv_cache, metadata, **kwargs):
        state = metadata.backend_state.get(_STATE)
        if state is not None:  # a split step: every rank caches the whole step's KV
            slots, num_tokens, chunk = state
            comm = self.pcp.communicator
            keys = comm.all_gather(_pad_rows(key, chunk))[:num_tokens]
            values = comm.all_gather(_pad_rows(value, chunk))[:num_tokens]
            write_kv(keys, values, kv_cache, slots, kwargs.get("k_scale"), kwargs.get("v_scale"))
        return self.inner.forward(spec, query, key, value, kv_cache, metadata, **kwargs)
