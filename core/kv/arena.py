"""The KV arena: one buffer of bytes from the platform allocator, carved into pages.

Layout. The arena holds `num_layer_slots` regions; region s holds, for every block id b,
one page of layer-slot s: its keys then its values, [2, num_blocks, block_size, kv_heads,
head_size]. The layers of one KV group (core/kv/groups.py) own one slot each, so a block
id names one page in each slot: allocating block b to a group gives the request that
block in every layer of the group. Groups of other attention types (sliding windows) map
their layers onto the same slots, so that all types draw block ids from one free list and
the split between them moves with the workload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.platforms.interfaces import Allocator, AttentionSpec


@dataclass(slots=True)
class KVArena:
    buffer: torch.Tensor  # uint8, from the platform's KV allocator
    num_blocks: int
    page_bytes: int  # bytes of one block in one layer slot
    layer_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, kv_heads, head]

    @staticmethod
    def page_bytes_for(spec: AttentionSpec) -> int:
        itemsize = torch.empty((), dtype=spec.dtype).element_size()
        return 2 * spec.block_size * spec.num_kv_heads * spec.head_size * itemsize

    @classmethod
    def create(
        cls,
        allocator: Allocator,
        specs: list[AttentionSpec],
        *,
        num_blocks: int | None,
        num_bytes: int,
        device: torch.device,
        layer_slots: Sequence[int] | None = None,
    ) -> KVArena:
        """Allocate an arena for layers with `specs`: `num_blocks` blocks if given, else as
        many as fit in `num_bytes` (capped by the allocator's limit). `layer_slots[i]` is
        layer i's slot (`KVLayout.layer_slot`); None gives every layer its own."""
        if not specs:
            raise ValueError("the model declares no attention layers; nothing to cache")
        page_bytes = {cls.page_bytes_for(s) for s in specs}
        if len(page_bytes) != 1:
            raise ValueError(f"layers need different KV page sizes {sorted(page_bytes)}")
        page = page_bytes.pop()
        if layer_slots is None:
            layer_slots = range(len(specs))
        num_slots = max(layer_slots) + 1
        if num_blocks is None:
            budget = min(num_bytes, allocator.bytes_limit() - allocator.bytes_in_use())
            num_blocks = budget // (page * num_slots)
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget of {num_bytes} bytes holds no block of "
                f"{page * num_slots} bytes; give it more memory"
            )
        buffer = allocator.allocate(num_blocks * page * num_slots)
        # Kernels may read a block's unwritten tail (and multiply it by a zero probability);
        # uninitialised memory can hold NaN bit patterns, and 0 * NaN is NaN.
        buffer.zero_()
        caches = []
        for slot, spec in zip(layer_slots, specs, strict=True):
            region = buffer[slot * num_blocks * page : (slot + 1) * num_blocks * page]
            caches.append(
                region.view(spec.dtype).view(
                    2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
                )
            )
        return cls(buffer=buffer, num_blocks=num_blocks, page_bytes=page, layer_caches=caches)
