"""KV accounting for requests: which blocks each request holds, prefix-cache lookups and
admission. One allocator per attention type draws from the shared `BlockPool`.

Only full attention has an allocator today. Sliding-window (a ring freeing blocks that
leave the window) and recurrent state (one slot per sequence) plug in as further
`AttentionTypeAllocator`s drawing from the same pool; the manager asks each for its need
and admits a request only when the joint need fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.kv.block_pool import BlockPool, KVBlock
from tokenmill.kv.hashing import hash_blocks
from tokenmill.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache


class FullAttentionAllocator:
    """Block tables for full attention: a request holds one block per block_size tokens."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVBlock]] = {}

    def num_blocks_needed(self, request: Request, num_tokens: int, num_new_hits: int) -> int:
        """Fresh blocks needed so `request` can hold `num_tokens` tokens."""
        held = len(self.req_to_blocks.get(request.request_id, ())) + num_new_hits
        return max(0, -(-num_tokens // self.block_size) - held)

    def longest_hit(self, request: Request, max_tokens: int) -> list[KVBlock]:
        """Cached blocks matching the request's leading full blocks, up to max_tokens."""
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[: max_tokens // self.block_size]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, request: Request, num_tokens: int, hits: list[KVBlock]) -> None:
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        self.pool.touch(hits)
        blocks.extend(hits)
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the blocks that the first `num_tokens` tokens fill completely."""
        blocks = self.req_to_blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for block, block_hash in zip(blocks[:num_full], request.block_hashes[:num_full]):
            self.pool.cache(block, block_hash)

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free(reversed(blocks))

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, ())]


class KVCacheManager:
    """The scheduler's view of KV memory. Pure Python; never touches tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.full = FullAttentionAllocator(self.pool, block_size)
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's block keys to cover its newly full blocks."""
        if not self.enable_prefix_caching:
            return
        start = len(request.block_hashes)
        parent = request.block_hashes[-1] if start else None
        request.block_hashes.extend(
            hash_blocks(request.all_token_ids, self.block_size, request.extra_keys, start, parent)
        )

    def find_cached_prefix(self, request: Request) -> tuple[list[KVBlock], int]:
        """The cached blocks that cover the request's leading tokens, and how many tokens.

        At least one token is always left to compute, since the step that computes it
        produces the logits to sample from.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self.update_block_hashes(request)
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0  # every prompt position must be computed to score it
        hits = self.full.longest_hit(request, request.num_tokens - 1)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count one admitted request's prefix-cache lookup in the stats."""
        self.stats.queries += num_queried
        self.stats.hits += num_hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hits: list[KVBlock] | None = None,
        publish: bool = True,
    ) -> bool:
        """Reserve KV for `num_new_tokens` more tokens (after `hits`, if any).

        `hits` are for a request that holds no KV yet, and must be what
        `find_cached_prefix` returned with no allocation in between: allocating takes the
        least recently freed blocks, cached ones included, so an older lookup may name a
        block that now holds another request's tokens. Stale hits raise RuntimeError.
        Returns False, changing nothing, when the pool cannot supply the blocks.
        `publish=False` keeps the new blocks out of the prefix cache (their content is
        still being loaded by the KV connector; `cache_blocks` publishes them after).
        """
        hits = hits or []
        if hits:
            self._check_hits(request, hits)
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens
        # Cached hits sitting in the free queue stop being allocatable once touched.
        num_hits_free = sum(1 for b in hits if b.ref_cnt == 0)
        need = self.full.num_blocks_needed(request, total, len(hits))
        if need + num_hits_free > self.pool.num_free_blocks:
            return False
        self.full.allocate(request, total, hits)
        if self.enable_prefix_caching and publish:
            self.update_block_hashes(request)
            self.full.cache_full_blocks(request, total)
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's blocks that its first `num_tokens` tokens fill."""
        if self.enable_prefix_caching:
            self.full.cache_full_blocks(request, num_tokens)

    def _check_hits(self, request: Request, hits: list[KVBlock]) -> None:
        if request.num_computed_tokens or self.full.block_ids(request):
            raise RuntimeError(
                f"request {request.request_id!r} already holds KV: prefix-cache hits only "
                "start a request"
            )
        if len(hits) > len(request.block_hashes) or any(
            self.pool.get_cached_block(h) is not b for b, h in zip(hits, request.block_hashes)
        ):
            raise RuntimeError(
                f"stale prefix-cache hits for request {request.request_id!r}: look them up "
                "again (find_cached_prefix) right before allocate_slots"
            )

    def free(self, request: Request) -> None:
        self.full.free(request)

    def block_ids(self, request: Request) -> list[int]:
        return self.full.block_ids(request)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
