"""The pool of KV blocks: reference counts, the free blocks in eviction order and the
prefix cache.

Pure Python with no device import: block ids index pages of the KV arena, but the pool
never touches memory.

Eviction (which free block an allocation takes), `eviction=`:

- "benefit" (the default): free blocks that hold nothing cached go first (oldest first);
  then the cached block of least priority, where a block's priority is set when it
  becomes free (or is re-scored while free) as `clock + benefit`: GreedyDual-Size (Cao
  and Irani, 1997) with `benefit` the recompute its content saves per block id of the
  unit it belongs to (every block id is the same bytes, so per block id is per byte; the
  manager's `PrefixScorer`, core/kv/eviction.py, sets it), and `clock` the priority of
  the last cached block evicted. The clock makes recency count in the same units: a page
  freed long ago competes with fresh ones only by a benefit larger by how much the clock
  has risen since. A recurrent checkpoint's pages are one unit (`link`): evicting one
  drops the whole checkpoint, as its other pages are worthless without it. A heap with
  lazy deletion: O(log n) per free, eviction and re-score, amortised.
- "lru": one queue in the order blocks were freed, cached or not; allocation takes the
  least recently freed (vLLM's free queue; the baseline the benchmarks compare against).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from tokenmill.kv.hashing import BlockHash

EvictionPolicy = Literal["benefit", "lru"]
EVICTION_POLICIES: tuple[str, ...] = ("benefit", "lru")


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and cached
    # "benefit" eviction: recompute saved per block id (set by the manager's scorer), the
    # clock when it last became free, the heap key while free and cached, the tick of its
    # live heap entry (-1: none) and the other pages of its unit (a recurrent
    # checkpoint), if any
    benefit: float = 0.0
    freed_at: float = 0.0
    priority: float = 0.0
    entry: int = -1
    unit: tuple[KVBlock, ...] | None = None


# The entry of a block table that holds no block (a sliding window's blocks that left the
# window). Its id, 0, names a page that a pool with `reserve_null` never hands out;
# attention backends never read it (they read only what the window covers).
NULL_BLOCK = KVBlock(0, ref_cnt=1)


class BlockPool:
    """Hands out blocks; keeps freed full blocks findable by hash until they are reused.

    A block is free exactly when its ref_cnt is 0. Allocation takes a free block (the one
    `eviction` picks, see the module doc) and drops its cache entry, so cached content
    lives as long as the pool can afford it.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        reserve_null: bool = False,
        eviction: EvictionPolicy = "benefit",
    ) -> None:
        """`reserve_null`: block 0 is the null block (NULL_BLOCK), never handed out; block
        tables with holes need it."""
        if num_blocks < 1 + reserve_null:
            raise ValueError(f"num_blocks={num_blocks}: the KV pool needs at least one block")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction={eviction!r}: choose one of {list(EVICTION_POLICIES)}")
        self.num_blocks = num_blocks
        self.num_reserved = int(reserve_null)
        self.enable_caching = enable_caching
        self.eviction = eviction
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        if reserve_null:
            self.blocks[0] = NULL_BLOCK
        # "lru": every free block, least recently freed first; "benefit": the free blocks
        # that hold nothing cached (taken first)
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[self.num_reserved :]
        )
        self._cached: dict[BlockHash, KVBlock] = {}
        # "benefit": (priority, tick, block) of the free cached blocks; an entry is live
        # while block.entry == tick (re-scoring or taking a block leaves its old entry)
        self._heap: list[tuple[float, int, KVBlock]] = []
        self._num_free_cached = 0
        self._ticks = itertools.count()
        self.clock = 0.0  # priority of the last cached block evicted ("benefit")
        # told of every cached block whose content an allocation (or a reset) is about to
        # drop, before it is reused: KV offload moves it to its host tier
        self.evict_listener: Callable[[KVBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, cached-but-unused ones included."""
        return len(self._free) + self._num_free_cached

    @property
    def num_usable_blocks(self) -> int:
        """Blocks the pool can ever hand out (all but the null block)."""
        return self.num_blocks - self.num_reserved

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by live requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def free_blocks(self) -> Iterator[KVBlock]:
        """Every free block (any order); for accounting and tests."""
        yield from self._free.values()
        yield from (b for _, tick, b in self._heap if b.entry == tick)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks with ref_cnt 1. The caller checked `num_free_blocks`."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(
                f"asked for {num_blocks} KV blocks with only {self.num_free_blocks} free"
            )
        out = []
        for _ in range(num_blocks):
            block = self._take()
            block.ref_cnt = 1
            out.append(block)
        return out

    def _take(self) -> KVBlock:
        """Remove the block eviction picks from the free blocks, its cache entry dropped."""
        if self._free:
            _, block = self._free.popitem(last=False)
            self._evict(block, notify=True)
            return block
        while True:  # benefit: the least priority among the free cached blocks
            priority, tick, block = heapq.heappop(self._heap)
            if block.entry == tick:
                break
        block.entry = -1
        self._num_free_cached -= 1
        self.clock = max(self.clock, priority)
        self._evict(block, notify=True)
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._unfree(block)
            block.ref_cnt += 1

    def _unfree(self, block: KVBlock) -> None:
        if block.entry >= 0:
            block.entry = -1
            self._num_free_cached -= 1
        else:
            del self._free[block.block_id]

    def free(self, blocks: Iterable[KVBlock], reuse_first: bool = False) -> None:
        """Drop a reference on each block; unreferenced blocks become free.

        Pass a request's blocks tail first, so that (under "lru") the ends of sequences
        are reused before the shared prefixes they hang from. `reuse_first`: unreferenced
        blocks that hold nothing cached are reused before any other free block (a
        recurrent state slot: its bytes are worth nothing once its sequence is gone).
        Under "benefit" a freed cached block's priority is `clock + block.benefit`.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"KV block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            block.freed_at = self.clock
            if self.eviction == "benefit" and block.block_hash is not None:
                self._push(block, self.clock + block.benefit)
                self._num_free_cached += 1
                continue
            self._free[block.block_id] = block
            if reuse_first and block.block_hash is None:
                self._free.move_to_end(block.block_id, last=False)

    def _push(self, block: KVBlock, priority: float) -> None:
        block.priority = priority
        block.entry = next(self._ticks)
        heapq.heappush(self._heap, (priority, block.entry, block))
        if len(self._heap) > 2 * self._num_free_cached + 64:  # drop the dead entries
            self._heap = [e for e in self._heap if e[2].entry == e[1]]
            heapq.heapify(self._heap)

    def rescore(self, block: KVBlock, benefit: float, used_now: bool = True) -> None:
        """Set a cached block's benefit (recompute saved per block id). A free one's
        priority becomes max(its priority, base + benefit), base the clock now if the
        page counts as used now (`used_now`), else when it became free: re-scoring only
        ever keeps a page longer, so a prefix block never drops below the pages hanging
        from it that were scored before. Only the benefit under "lru"."""
        block.benefit = benefit
        base = self.clock if used_now else block.freed_at
        if block.entry >= 0 and base + benefit > block.priority:
            self._push(block, base + benefit)

    def link(self, pages: list[KVBlock]) -> None:
        """Make cached `pages` one unit: dropping any one from the cache drops them all
        (a checkpoint spread over several pages). Only under "benefit"."""
        if self.eviction == "benefit" and len(pages) > 1:
            unit = tuple(pages)
            for page in pages:
                page.unit = unit

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Make blocks unfindable by hash (their content is no longer wanted); references
        are unchanged (a free one is now reused first under "benefit")."""
        for block in blocks:
            self._evict(block)

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Make a full block findable by its hash. The first block with a hash wins."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        if block.ref_cnt == 0 and self.eviction == "benefit":  # free: into the heap
            del self._free[block.block_id]
            self._push(block, self.clock + block.benefit)
            self._num_free_cached += 1
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks[self.num_reserved :]:
            self._evict(block, notify=True)
        self._cached.clear()
        self._heap.clear()
        return True

    def _evict(self, block: KVBlock, notify: bool = False) -> None:
        """Drop the block's cache entry (and its unit's); a free cached page of the unit
        joins the uncached free blocks. `notify`: its content is dropped with the entry
        (eviction, reset), so `evict_listener` hears of each page first."""
        if block.block_hash is None:
            return
        if notify and self.evict_listener is not None and (
            self._cached.get(block.block_hash) is block
        ):
            self.evict_listener(block)
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
        if block.entry >= 0:  # free and cached: it holds nothing now
            block.entry = -1
            self._num_free_cached -= 1
            self._free[block.block_id] = block
        unit, block.unit = block.unit, None
        for page in unit or ():
            self._evict(page, notify)
