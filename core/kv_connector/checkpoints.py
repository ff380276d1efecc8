"""Recurrent-state checkpoints in the KV tiers: the scheduler side's part for models with
LINEAR groups (Qwen3-Next's Gated DeltaNet, Kimi Linear's KDA, Bamba's Mamba2).

A checkpoint (core/kv/recurrent.py) is the state of one recurrent group after a block
boundary, packed over `state_pages` block ids. Each of those pages is an object of the
ordinary format (objects.py: the block id's page in every arena slot), named by the
prefix-cache key the device gives it (`checkpoint_key`: the block hash tagged with the
group and the page) under the layout fingerprint. So a checkpoint, like an attention
block, is stored once per shared prefix, whichever session computed it.

- Lookups: a tier hit of n blocks needs, besides the attention groups' blocks, every
  page of every recurrent group's checkpoint after block n (`whole`): n walks down to
  the nearest boundary the tiers hold one at.
- Loads: those pages are written into fresh block ids the scheduler allocated as the
  hit's checkpoint (read by the first step after the load, never written: copy on
  extend); the attention blocks up to n come with them in the same job.
- Saves: the kept checkpoints (every `interval_blocks` and the prompt end, as the
  device's `CheckpointPolicy` keeps them) are saved after the step that writes them.
  The rolling one, the sequence's latest boundary, is superseded every block of decode,
  so it is saved once, when the request finishes or is preempted: the scheduler holds
  its pages (one more reference) until the worker reports the save (`hold`).
"""

from __future__ import annotations

from tokenmill.engine.request import Request
from tokenmill.kv.groups import KVGroup
from tokenmill.kv.recurrent import checkpoint_key
from tokenmill.kv_connector.objects import ObjectKey, object_key
from tokenmill.platforms.interfaces import AttentionKind
from tokenmill.platforms.kv_messages import BlockTransfer


class CheckpointObjects:
    """Keys, lookups and held saves of the recurrent groups' checkpoints."""

    def __init__(self, fingerprint: bytes, groups: tuple[KVGroup, ...] | None) -> None:
        self.fingerprint = fingerprint
        # group id -> block ids (pages) one checkpoint takes
        self.pages: dict[int, int] = {
            g.group_id: g.state_pages for g in groups or () if g.kind == AttentionKind.LINEAR
        }
        self._unsent: list[BlockTransfer] = []  # held pages to save with the next step
        self._held: dict[ObjectKey, object] = {}  # key -> its held block, until reported
        self._released: list = []  # held blocks whose save ended: to give back

    def __bool__(self) -> bool:
        return bool(self.pages)

    def keys(self, request: Request, num_blocks: int) -> list[tuple[int, ObjectKey]]:
        """(group, object key) of every page of every recurrent group's checkpoint after
        the request's first `num_blocks` blocks, in group then page order."""
        block_hash = request.block_hashes[num_blocks - 1]
        return [
            (g, object_key(self.fingerprint, checkpoint_key(block_hash, g, p)))
            for g, n in self.pages.items() for p in range(n)
        ]

    def lookup(
        self, stack, request: Request, start: int, end: int, in_flight=None,
    ) -> dict[int, list[str | None]]:
        """Boundary j (blocks, start < j <= end) -> where each page of its checkpoint is
        (`keys` order; None: no tier), in one batched lookup. `in_flight(key)`: the tier
        an object no tier holds yet is on its way to (a save or an eviction in flight),
        as the scheduler side counts blocks."""
        boundaries = list(range(start + 1, end + 1))
        keys = [k for j in boundaries for _, k in self.keys(request, j)]
        where = stack.locate(keys) if keys else []
        if in_flight is not None:
            where = [w if w is not None else in_flight(k) for k, w in zip(keys, where)]
        per = sum(self.pages.values())
        return {j: where[i * per : (i + 1) * per] for i, j in enumerate(boundaries)}

    @staticmethod
    def whole(found: dict[int, list[str | None]], num_blocks: int) -> bool:
        pages = found.get(num_blocks)
        return pages is not None and all(t is not None for t in pages)

    def load_blocks(
        self, request: Request, tables: list[list[int]], num_blocks: int
    ) -> list[tuple[int, BlockTransfer]]:
        """(group, transfer) of each checkpoint page after `num_blocks` blocks into the
        pages the scheduler allocated for it (`tables[g]`, `KVCacheManager.load_block_ids`)."""
        out = []
        page = dict.fromkeys(self.pages, 0)
        for g, key in self.keys(request, num_blocks):
            out.append((g, BlockTransfer(tables[g][page[g]], key)))
            page[g] += 1
        return out

    def saves(self, cache_keys: list[tuple[bytes, int]]) -> list[BlockTransfer]:
        """Transfers of checkpoint pages given as (prefix-cache key, block id)."""
        return [BlockTransfer(b, object_key(self.fingerprint, k)) for k, b in cache_keys]

    # ---- held rolling checkpoints ------------------------------------------------------
    def hold(self, pages: list, skip) -> list:
        """Queue the save of held checkpoint `pages` (KVBlocks cached under their
        prefix-cache keys) with the next step; `skip(key)`: whether that object needs no
        save (being saved, or in the first durable tier). Returns the pages to release now."""
        release = []
        for page in pages:
            key = object_key(self.fingerprint, page.block_hash)
            if key in self._held or skip(key):
                release.append(page)
                continue
            self._held[key] = page
            self._unsent.append(BlockTransfer(page.block_id, key))
        return release

    def take_unsent(self) -> list[BlockTransfer]:
        out, self._unsent = self._unsent, []
        return out

    def save_ended(self, key: ObjectKey) -> None:
        page = self._held.pop(key, None)
        if page is not None:
            self._released.append(page)

    def take_released(self) -> list:
        out, self._released = self._released, []
        return out

    @property
    def has_unsent(self) -> bool:
        return bool(self._unsent)

    @property
    def num_held(self) -> int:
        return len(self._held)
