"""The pool of KV blocks: reference counts, a free queue in LRU order and the prefix cache.

Pure Python with no device import: block ids index pages of the KV arena, but the pool
never touches memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from tokenmill.kv.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and cached


# The entry of a block table that holds no block (a sliding window's blocks that left the
# window). Its id, 0, names a page that a pool with `reserve_null` never hands out;
# attention backends never read it (they read only what the window covers).
NULL_BLOCK = KVBlock(0, ref_cnt=1)


class BlockPool:
    """Hands out blocks; keeps freed full blocks findable by hash until they are reused.

    A block is in the free queue exactly when its ref_cnt is 0. Allocation takes the
    least recently freed block first and drops its cache entry, so cached content lives
    as long as the pool can afford it.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, reserve_null: bool = False
    ) -> None:
        """`reserve_null`: block 0 is the null block (NULL_BLOCK), never handed out; block
        tables with holes need it."""
        if num_blocks < 1 + reserve_null:
            raise ValueError(f"num_blocks={num_blocks}: the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.num_reserved = int(reserve_null)
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        if reserve_null:
            self.blocks[0] = NULL_BLOCK
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[self.num_reserved :]
        )
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, cached-but-unused ones included."""
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks the pool can ever hand out (all but the null block)."""
        return self.num_blocks - self.num_reserved

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by live requests."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks with ref_cnt 1. The caller checked `num_free_blocks`."""
        if num_blocks > len(self._free):
            raise RuntimeError(
                f"asked for {num_blocks} KV blocks with only {len(self._free)} free"
            )
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock], reuse_first: bool = False) -> None:
        """Drop a reference on each block; unreferenced blocks join the free queue tail.

        Pass a request's blocks tail first, so that the ends of sequences are reused
        before the shared prefixes they hang from. `reuse_first`: unreferenced blocks
        that hold nothing cached go to the head instead, to be reused before any cached
        content is evicted (a recurrent state slot: its bytes are worth nothing once its
        sequence is gone).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"KV block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if reuse_first and block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Make blocks unfindable by hash (their content is no longer wanted); references
        and the free queue are unchanged."""
        for block in blocks:
            self._evict(block)

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Make a full block findable by its hash. The first block with a hash wins."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if len(self._free) != self.num_usable_blocks:
            return False
        for block in self.blocks[self.num_reserved :]:
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
