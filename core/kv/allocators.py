"""One block allocator per KV group, all drawing from the shared `BlockPool`.

Each allocator keeps every request's block table for its group: entry j covers the
request's tokens [j * block_size, (j + 1) * block_size). They differ in which entries
hold a real block:

- `FullAttentionAllocator`: every entry, for as long as the request runs.
- `SlidingWindowAllocator` (window w): only the entries that a query still needs. A query
  at position p sees positions (p - w, p], so once the request's next token is at
  position n, blocks wholly before n - w + 1 are never read again: they go back to the
  pool (findable by hash until reused, like any freed full block) and their entries
  become the null block, whose id no backend reads. A request at any length then holds
  about w / block_size + 1 blocks per layer of the group, plus the chunk it computes.

Prefix-cache keys are per group (a block of the same tokens is a different page in each
group): group 0 uses the request's block hashes as they are, group g > 0 tags them.
Pure Python with no device import.
"""

from __future__ import annotations

from tokenmill.engine.request import Request
from tokenmill.kv.block_pool import NULL_BLOCK, BlockPool, KVBlock
from tokenmill.kv.groups import KVGroup
from tokenmill.kv.hashing import BlockHash


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FullAttentionAllocator:
    """Block tables for full attention: a request holds one block per block_size tokens."""

    def __init__(self, pool: BlockPool, block_size: int, group: KVGroup | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group_id = group.group_id if group is not None else 0
        self._key_tag = b"/g%d" % self.group_id if self.group_id else b""
        self.req_to_blocks: dict[str, list[KVBlock]] = {}

    def key(self, block_hash: BlockHash) -> BlockHash:
        """The prefix-cache key of a block of this group."""
        return block_hash + self._key_tag

    def num_blocks_needed(self, request: Request, num_tokens: int, hits: list[KVBlock]) -> int:
        """Fresh blocks needed so `request` can hold `num_tokens` tokens after `hits`."""
        held = len(self.req_to_blocks.get(request.request_id, ())) + len(hits)
        return max(0, _cdiv(num_tokens, self.block_size) - held)

    def longest_hit(self, request: Request, max_tokens: int) -> list[KVBlock]:
        """Cached blocks matching the request's leading full blocks, up to max_tokens."""
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[: max_tokens // self.block_size]:
            block = self.pool.get_cached_block(self.key(block_hash))
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_blocks(self, request: Request, max_blocks: int) -> list[KVBlock | None]:
        """The cached block of each of the request's first `max_blocks` full blocks (None:
        not cached); full attention stops at the first miss, as no hit reaches past it."""
        return list(self.longest_hit(request, max_blocks * self.block_size))

    def first_needed_block(self, num_computed: int) -> int:
        """The first block a query at position `num_computed` (or later) can read."""
        return 0

    def hit_table(self, cached: list[KVBlock | None], num_blocks: int) -> list[KVBlock]:
        """The table a hit of `num_blocks` blocks starts with, from `cached_blocks` (the
        caller checked that the blocks from `first_needed_block` on are all there)."""
        first = self.first_needed_block(num_blocks * self.block_size)
        return [NULL_BLOCK] * first + cached[first:num_blocks]  # type: ignore[list-item]

    def release_outside_window(self, request: Request, num_computed: int) -> None:
        """Nothing leaves a full-attention context."""

    def take_hits(self, request: Request, hits: list[KVBlock]) -> None:
        """Start the request's table with a prefix-cache hit's blocks (taking a reference).

        Take every group's hits before any group allocates: a fresh allocation may evict
        free cached blocks, which may be another group's cached hits.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        self.pool.touch(b for b in hits if b is not NULL_BLOCK)
        blocks.extend(hits)

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Grow the request's table to cover `num_tokens` tokens with fresh blocks."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        need = _cdiv(num_tokens, self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the blocks that the first `num_tokens` tokens fill completely."""
        blocks = self.req_to_blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for block, block_hash in zip(blocks[:num_full], request.block_hashes[:num_full]):
            if block is not NULL_BLOCK:
                self.pool.cache(block, self.key(block_hash))

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free(b for b in reversed(blocks) if b is not NULL_BLOCK)

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, ())]

    def num_held(self, request: Request) -> int:
        """Real blocks (not the null block) the request holds in this group."""
        return sum(1 for b in self.req_to_blocks.get(request.request_id, ()) if b is not NULL_BLOCK)


class SlidingWindowAllocator(FullAttentionAllocator):
    """Block tables for a sliding window of `window` tokens: blocks leaving the window go
    back to the pool and become the null block in the table."""

    def __init__(self, pool: BlockPool, block_size: int, group: KVGroup) -> None:
        if group.sliding_window is None or group.sliding_window < 1:
            raise ValueError(f"group {group.group_id} has no sliding window: {group}")
        super().__init__(pool, block_size, group)
        self.window = group.sliding_window

    def first_needed_block(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1) // self.block_size

    def cached_blocks(self, request: Request, max_blocks: int) -> list[KVBlock | None]:
        """Every one of the first `max_blocks` blocks: a window may hit past a miss (a hit
        needs only the blocks its next query reads; the null block goes before them)."""
        return [
            self.pool.get_cached_block(self.key(h)) for h in request.block_hashes[:max_blocks]
        ]

    def release_outside_window(self, request: Request, num_computed: int) -> None:
        """Give back the blocks that no query from position `num_computed` on reads.

        Full ones stay findable by hash (they were cached when filled), so a later request
        with the same prefix can still hit them while the pool does not need them.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        released = []
        for j in range(min(self.first_needed_block(num_computed), len(blocks))):
            if blocks[j] is not NULL_BLOCK:
                released.append(blocks[j])
                blocks[j] = NULL_BLOCK
        self.pool.free(released)  # oldest first: the first to be reused
