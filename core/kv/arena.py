"""The KV arena: one buffer of bytes from the platform allocator, carved into pages.

Layout. The arena holds `num_layer_slots` regions; region s holds, for every block id b,
one page of layer-slot s: its keys then its values, [2, num_blocks, block_size, kv_heads,
head_size]. The layers of one KV group (core/kv/groups.py) own one slot each, so a block
id names one page in each slot: allocating block b to a group gives the request that
block in every layer of the group. Groups of other attention types (sliding windows) map
their layers onto the same slots, so that all types draw block ids from one free list and
the split between them moves with the workload.

Recurrent (LINEAR) layers see their slot's region as bytes, [2, num_blocks, page_bytes
// 2] uint8: the same two halves per block id as attention pages, so a block id names the
same bytes whichever group holds it. A state spanning several pages is packed over them
in table order (tokenmill.kv.state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.kv.groups import attention_page_bytes, page_bytes_of
from tokenmill.platforms.interfaces import Allocator, AttentionKind, AttentionSpec


@dataclass(slots=True)
class KVArena:
    buffer: torch.Tensor  # uint8, from the platform's KV allocator
    num_blocks: int
    page_bytes: int  # bytes of one block in one layer slot
    # per layer: [2, num_blocks, block_size, kv_heads, head] (attention) or uint8
    # [2, num_blocks, page_bytes // 2] (a recurrent layer's state pages)
    layer_caches: list[torch.Tensor]

    @staticmethod
    def page_bytes_for(spec: AttentionSpec) -> int:
        return attention_page_bytes(spec)

    @classmethod
    def page_bytes_of(cls, specs: list[AttentionSpec]) -> int:
        """The one page size of `specs` (every attention layer must agree; see
        `tokenmill.kv.groups.page_bytes_of`)."""
        if not specs:
            raise ValueError("the model declares no attention layers; nothing to cache")
        return page_bytes_of(specs)

    @classmethod
    def block_bytes_for(
        cls, specs: list[AttentionSpec], layer_slots: Sequence[int] | None = None
    ) -> int:
        """Bytes of one block id over every layer slot (`layer_slots`: as in `create`)."""
        num_slots = len(specs) if layer_slots is None else max(layer_slots) + 1
        return cls.page_bytes_of(specs) * num_slots

    @classmethod
    def create(
        cls,
        allocator: Allocator,
        specs: list[AttentionSpec],
        *,
        num_blocks: int,
        device: torch.device,
        layer_slots: Sequence[int] | None = None,
    ) -> KVArena:
        """Allocate an arena of `num_blocks` blocks for layers with `specs`. `layer_slots[i]`
        is layer i's slot (`KVLayout.layer_slot`); None gives every layer its own."""
        page = cls.page_bytes_of(specs)
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
        for slot, spec in zip(layer_slots, specs, strict=True):
            region = buffer[slot * num_blocks * page : (slot + 1) * num_blocks * page]
            if spec.kind == AttentionKind.LINEAR:
                caches.append(region.view(2, num_blocks, page // 2))
                continue
            caches.append(
                region.view(spec.dtype).view(
                    2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
                )
            )
        return cls(buffer=buffer, num_blocks=num_blocks, page_bytes=page, layer_caches=caches)
