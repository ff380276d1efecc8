"""Recurrent states in the KV arena's pages: read and write one layer's packed state.

A LINEAR layer's cache is its arena slot seen as bytes, uint8 [2, num_blocks, half]
(half = page_bytes // 2: the two halves of a block id, as attention pages split keys and
values). One sequence's state in that layer is `RecurrentStateSpec.num_bytes` bytes
packed over the pages of a list of block ids: page j of the list contributes its first
half then its second half, so the packed state is the concatenation, in list order, of
`cache[0, id]` and `cache[1, id]`. Each state tensor sits at its `offsets` entry.

Pages of one state are rarely consecutive block ids (they come from the shared free
list), so reading gathers them into new tensors and writing scatters back: a copy of the
state each way, which the recurrence's own pass over the state dominates. A platform
kernel may instead address the pages in place with the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.platforms.interfaces import RecurrentStateSpec


def pages_for(spec: RecurrentStateSpec, page_bytes: int) -> int:
    """Block ids one packed state needs at `page_bytes` per page."""
    return -(-spec.num_bytes // page_bytes)


def _index(cache: torch.Tensor, block_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.tensor([list(ids) for ids in block_ids], dtype=torch.int64, device=cache.device)


def read_states(
    cache: torch.Tensor, spec: RecurrentStateSpec, block_ids: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """The states packed in `block_ids[i]` (one list per sequence, each the same length,
    at least `pages_for` pages): one tensor per `spec.tensors` entry, [B, *shape] in its
    dtype, B = len(block_ids). New tensors: writing them changes nothing in the cache."""
    if not block_ids:
        return [torch.empty(0, *t.shape, dtype=t.dtype, device=cache.device) for t in spec.tensors]
    idx = _index(cache, block_ids)  # [B, P]
    # [2, B, P, half] -> [B, P, 2, half] -> [B, P * page]
    packed = cache[:, idx].permute(1, 2, 0, 3).reshape(idx.shape[0], -1)
    out = []
    for t, offset in zip(spec.tensors, spec.offsets, strict=True):
        raw = packed[:, offset : offset + t.num_bytes].contiguous()
        out.append(raw.view(t.dtype).view(idx.shape[0], *t.shape))
    return out


def write_states(
    cache: torch.Tensor,
    spec: RecurrentStateSpec,
    block_ids: Sequence[Sequence[int]],
    states: Sequence[torch.Tensor],
) -> None:
    """Pack `states` ([B, *shape] per `spec.tensors` entry, cast to its dtype) into the
    pages of `block_ids[i]` for sequence i. Bytes past the packed state are left as
    they are."""
    if not block_ids:
        return
    idx = _index(cache, block_ids)
    num_seqs, num_pages = idx.shape
    half = cache.shape[-1]
    packed = cache[:, idx].permute(1, 2, 0, 3).reshape(num_seqs, -1)  # a copy
    for t, offset, value in zip(spec.tensors, spec.offsets, states, strict=True):
        raw = value.to(t.dtype).contiguous().view(num_seqs, -1).view(torch.uint8)
        packed[:, offset : offset + t.num_bytes] = raw
    cache[:, idx] = packed.view(num_seqs, num_pages, 2, half).permute(2, 0, 1, 3)


def zero_states(spec: RecurrentStateSpec, num_seqs: int, device: torch.device) -> list[torch.Tensor]:
    """Fresh states (a sequence at token 0) for `num_seqs` sequences."""
    return [torch.zeros(num_seqs, *t.shape, dtype=t.dtype, device=device) for t in spec.tensors]
