"""The KV arena: one buffer of bytes from the platform allocator, carved into pages.

Layout. The arena holds `num_layer_slots` regions; region s holds, for every block id b,
one page of layer-slot s, viewed in the shape the layer's attention backend declares
(`AttentionBackend.kv_cache_shape`; the standard one is
`tokenmill.platforms.interfaces.kv_cache_shape`: keys then values, [2, num_blocks,
block_size, kv_heads, head_size], or an MLA layer's latent rows, [num_blocks,
block_size, kv_lora_rank + rope_dim]). The layers of one KV group (core/kv/groups.py) own one slot each, so a block
id names one page in each slot: allocating block b to a group gives the request that
block in every layer of the group. Groups of other attention types (sliding windows) map
their layers onto the same slots, so that all types draw block ids from one free list and
the split between them moves with the workload.

Recurrent (LINEAR) layers see their slot's region as bytes, [2, num_blocks, page_bytes
// 2] uint8: the same two halves per block id as attention pages, so a block id names the
same bytes whichever group holds it. Beside MLA layers, whose pages are block-major
(block b's latent rows contiguous), that view is a transposed one of [num_blocks, 2,
half], for the same reason. A state spanning several pages is packed over them
in table order (tokenmill.platforms.kit.kv_state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.kv.groups import page_bytes_of
from tokenmill.platforms.interfaces import (
    Allocator,
    AttentionBackend,
    AttentionKind,
    AttentionSpec,
    kv_cache_shape,
)


@dataclass(slots=True)
class KVArena:
    buffer: torch.Tensor  # uint8, from the platform's KV allocator
    num_blocks: int
    page_bytes: int  # bytes of one block in one layer slot
    # per layer: in its backend's kv_cache_shape (attention), or uint8 [2, num_blocks,
    # page_bytes // 2] (a recurrent layer's state pages)
    layer_caches: list[torch.Tensor]
    num_slots: int = 1  # layer slots: regions of num_blocks pages each
    # block b's page is contiguous in each slot (MLA arenas) rather than two halves,
    # [0, b] and [1, b] of a [2, num_blocks, page_bytes // 2] view (see `page_rows`)
    block_major: bool = False

    def page_rows(self) -> list[torch.Tensor]:
        """Per slot, its region as bytes [H, num_blocks, page_bytes // H]: block b's page
        is rows [:, b] (H = 2, keys then values, or 1 where pages are block-major). Every
        group that may hold block b sees these bytes (the layout rule above), so moving
        them moves the block whatever it holds: attention KV, MLA latents, state pages."""
        n, page = self.num_blocks, self.page_bytes
        halves = 1 if self.block_major else 2
        return [
            self.buffer[s * n * page : (s + 1) * n * page].view(halves, n, page // halves)
            for s in range(self.num_slots)
        ]

    @staticmethod
    def cache_shape(
        spec: AttentionSpec, num_blocks: int, backend: AttentionBackend | None = None
    ) -> tuple[int, ...]:
        """One attention layer's cache shape: its backend's declared layout, else the
        standard one (`tokenmill.platforms.interfaces.kv_cache_shape`)."""
        if backend is None:
            return kv_cache_shape(spec, num_blocks)
        return tuple(backend.kv_cache_shape(spec, num_blocks))

    @classmethod
    def page_bytes_for(cls, spec: AttentionSpec, backend: AttentionBackend | None = None) -> int:
        """Bytes of one block of one attention layer."""
        return math.prod(cls.cache_shape(spec, 1, backend)) * spec.kv_dtype.itemsize

    @classmethod
    def page_bytes_of(
        cls, specs: list[AttentionSpec], backends: Sequence[AttentionBackend] | None = None
    ) -> int:
        """The one page size of `specs` (every attention layer must agree; see
        `tokenmill.kv.groups.page_bytes_of`), with each layer's backend's declared layout
        when `backends` are given."""
        if not specs:
            raise ValueError("the model declares no attention layers; nothing to cache")
        page = page_bytes_of(specs)
        if backends is not None:
            declared = {
                cls.page_bytes_for(s, b)
                for s, b in zip(specs, backends, strict=True)
                if s.kind != AttentionKind.LINEAR
            }
            if declared - {page}:
                raise ValueError(
                    f"attention backends declare pages of {sorted(declared)} bytes; the "
                    f"layers' specs need {page}: a declared layout must hold the same bytes"
                )
        return page

    @classmethod
    def block_bytes_for(
        cls,
        specs: list[AttentionSpec],
        layer_slots: Sequence[int] | None = None,
        backends: Sequence[AttentionBackend] | None = None,
    ) -> int:
        """Bytes of one block id over every layer slot (`layer_slots`, `backends`: as in
        `create`)."""
        num_slots = len(specs) if layer_slots is None else max(layer_slots) + 1
        return cls.page_bytes_of(specs, backends) * num_slots

    @classmethod
    def create(
        cls,
        allocator: Allocator,
        specs: list[AttentionSpec],
        *,
        num_blocks: int,
        device: torch.device,
        layer_slots: Sequence[int] | None = None,
        backends: Sequence[AttentionBackend] | None = None,
    ) -> KVArena:
        """Allocate an arena of `num_blocks` blocks for layers with `specs`. `layer_slots[i]`
        is layer i's slot (`KVLayout.layer_slot`); None gives every layer its own.
        `backends[i]` is layer i's attention backend, whose `kv_cache_shape` its pages are
        viewed as (None: the standard layouts)."""
        page = cls.page_bytes_of(specs, backends)
        if layer_slots is None:
            layer_slots = range(len(specs))
        num_slots = max(layer_slots) + 1
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the KV arena needs at least one block")
        # Not zeroed: touching every page of a large arena at start costs seconds and
        # commits memory the pool may never use. Unwritten slots (a block's tail, freed
        # blocks) may hold anything, NaN bit patterns included; attention backends must
        # keep them out of every result (mask, never multiply by a zero probability),
        # which conformance tier T1 checks with NaN-filled caches.
        buffer = allocator.allocate(num_blocks * page * num_slots)
        caches = []
        block_major = _block_major(specs)
        layer_backends = backends if backends is not None else [None] * len(specs)
        for slot, spec, backend in zip(layer_slots, specs, layer_backends, strict=True):
            region = buffer[slot * num_blocks * page : (slot + 1) * num_blocks * page]
            if spec.kind == AttentionKind.LINEAR:
                if block_major:  # same [2, num_blocks, half] shape, block b's bytes contiguous
                    caches.append(region.view(num_blocks, 2, page // 2).transpose(0, 1))
                else:
                    caches.append(region.view(2, num_blocks, page // 2))
                continue
            shape = cls.cache_shape(spec, num_blocks, backend)
            caches.append(region.view(spec.kv_dtype).view(*shape))
        return cls(buffer=buffer, num_blocks=num_blocks, page_bytes=page, layer_caches=caches,
                   num_slots=num_slots, block_major=block_major)


def _block_major(specs: list[AttentionSpec]) -> bool:
    """Whether block b's page is contiguous in each slot (MLA's latent rows: [num_blocks,
    block_size, latent]) rather than two halves far apart (multi-head keys then values:
    [2, num_blocks, ...]). A block id must name the same bytes for every group that may
    hold it, so recurrent layers' state views follow the attention layers' convention,
    and the two attention conventions cannot share an arena."""
    kinds = {s.kind for s in specs}
    if AttentionKind.MLA in kinds and kinds & {AttentionKind.FULL, AttentionKind.SLIDING_WINDOW}:
        raise ValueError(
            "the model mixes MLA layers (block-major latent pages) with multi-head attention "
            "layers (keys-then-values pages) in one KV arena; that is not supported"
        )
    return AttentionKind.MLA in kinds
