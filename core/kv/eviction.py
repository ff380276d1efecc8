"""What a cached page is worth: the benefit that "benefit" eviction ranks free cached
pages by (core/kv/block_pool.py keeps them in a heap of `clock + benefit`).

A page's benefit is the recompute it saves a later request, per block id it takes (every
block id is one page in each arena slot, the same bytes whatever group holds it, so per
block id is per byte; a recurrent checkpoint is `state_pages` block ids per group).

Cost (`RecomputeCost`). Recomputing the token at position p costs, in each layer, 1 (its
projections and MLP, or its recurrence: the same at any depth) plus ctx / attention_span
for attending over its ctx visible positions: ctx = p + 1 under full attention and MLA,
min(p + 1, window) under a sliding window, 0 in a recurrent layer. attention_span is 6 x
the model's width (query heads x head size): per token a layer's matmuls cost about 12
width^2 multiply-adds and attention 2 width per visible position. C(t), a prefix of t
tokens, is what a hit of t tokens saves; a full-attention block deep in a context costs
more than one near its start.

Hit points. A hit can end at the boundary after block j only where every group can serve
it (`KVCacheManager.find_cached_prefix`): full attention needs blocks 0..j-1 cached, a
sliding window the blocks its next query reads, a recurrent group a checkpoint exactly
there. Between the hit points p_1 < ... < p_K of a request's prefix lie segments: segment
k is hit point p_k and the pages only it and deeper hit points need: the full-attention
blocks [p_{k-1}, p_k), the window blocks p_k's query reads that no shallower hit point
reads, and the checkpoints at p_k. Losing any of them loses the hit at p_k (a checkpoint
is useless without the attention pages before it, and attention pages past the last
checkpoint end no hit): a request that would hit there falls back to p_{k-1}, so segment
k is worth S_k = (C(p_k) - C(p_{k-1})) / its block ids. Every page of segment k gets
benefit max(S_k, S_{k+1}, ..., S_K): a segment is never ranked below one hanging from it,
since evicting it would also make the deeper ones useless, so a prefix is evicted from
its end. Pages of the prefix that end no hit (full-attention blocks past p_K, window
blocks no hit point reads, checkpoints where another group has none) get 0 and go first
among cached pages.

When. `score_chain` runs when a request frees its KV (finished or preempted), over its
whole computed prefix: O(blocks x groups) lookups, the order of freeing its tables.
Pages a running request frees earlier (window blocks leaving the window, checkpoints
once written) get `provisional` scores when published: the segment from the previous
checkpoint (or block) to the boundary just published, as if the prefix ended there.
Re-scored at the end, a checkpoint counts as used then (it is state of the prefix the
request used to its end, like the full-attention blocks before it, which are useless
without it), while a window block keeps the clock of when it left the window: no deeper
hit point needs it, so a long context's early window blocks age as they would under LRU.

What the others do. vLLM's v1 KV manager evicts from one LRU free queue for every
group (a request's blocks freed tail first; with Mamba layers, states are kept on the
grid of its enlarged, unified block size). SGLang's radix cache evicts least recently
used leaves; its Mamba radix cache keeps two LRU lists, one for KV and one for states,
and drops states (leaving KV-only tombstones) by recency alone. Neither weighs what a
page saves against the bytes it takes. Under LRU a prompt-end checkpoint, freed when the
prompt was written, goes before the attention blocks freed when the request ended,
which are useless without it; here the large checkpoint and the short segment it would
serve compete by recompute per byte, pages that end no hit go first, and a deep history
(attention costs more the deeper it is) outlives a shallow one freed later. Marconi
(Pan et al., MLSys 2025) scores hybrid radix-tree nodes by FLOPs saved per byte plus a
tuned recency weight; GreedyDual's clock gives recency without a weight to tune. For
agent workloads (every turn repeats a growing history; retries and edits diverge near
its end) what a hit saves most per byte is the deep segments of long histories.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.engine.request import Request
from tokenmill.kv.allocators import FullAttentionAllocator, SlidingWindowAllocator
from tokenmill.kv.block_pool import NULL_BLOCK, BlockPool, KVBlock
from tokenmill.kv.groups import KVGroup
from tokenmill.kv.recurrent import RecurrentStateAllocator
from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec

DEFAULT_WIDTH = 4096  # query heads x head size assumed when the specs are not given


@dataclass(frozen=True, slots=True)
class RecomputeCost:
    """C(t): the cost of recomputing a prefix of t tokens (see the module doc), in units
    of one layer's per-token projections."""

    # per group: (layers, window: None = full attention, 0 = recurrent)
    groups: tuple[tuple[int, int | None], ...]
    attention_span: float

    @classmethod
    def for_groups(cls, groups: Sequence[KVGroup], width: int = DEFAULT_WIDTH) -> RecomputeCost:
        """The cost of `groups`' layers at `width` (query heads x head size)."""
        return cls(_merged(
            (max(1, len(g.layers)), 0 if g.kind == AttentionKind.LINEAR else g.sliding_window)
            for g in groups
        ), 6.0 * width)

    @classmethod
    def from_specs(cls, specs: Sequence[AttentionSpec]) -> RecomputeCost:
        """The cost of a model's layers, the width its widest attention layer's."""
        widths = [s.num_heads * s.head_size for s in specs if s.kind != AttentionKind.LINEAR]
        return cls(_merged(
            (1, 0 if s.kind == AttentionKind.LINEAR
             else s.sliding_window if s.kind == AttentionKind.SLIDING_WINDOW else None)
            for s in specs
        ), 6.0 * max(widths, default=DEFAULT_WIDTH))

    def __call__(self, t: int) -> float:
        total = 0.0
        for layers, window in self.groups:
            if window == 0:  # recurrent
                total += layers * t
                continue
            if window is None or t <= window:
                visible = t * (t + 1) / 2
            else:
                visible = window * (window + 1) / 2 + (t - window) * window
            total += layers * (t + visible / self.attention_span)
        return total


def _merged(groups) -> tuple[tuple[int, int | None], ...]:
    """(layers, window) pairs with the layers of one window summed (the cost is linear
    in the layer count), in first-seen order."""
    layers: dict[int | None, int] = {}
    for count, window in groups:
        layers[window] = layers.get(window, 0) + count
    return tuple((count, window) for window, count in layers.items())


class PrefixScorer:
    """Sets the benefit of the cached pages of a request's prefix (module doc)."""

    def __init__(self, allocators: Sequence, block_size: int, cost: RecomputeCost) -> None:
        self.block_size = block_size
        self.cost = cost
        self.full = [a for a in allocators if type(a) is FullAttentionAllocator]
        self.windows = [a for a in allocators if isinstance(a, SlidingWindowAllocator)]
        self.recurrent = [a for a in allocators if isinstance(a, RecurrentStateAllocator)]
        self.checkpoint_pages = sum(a.state_pages for a in self.recurrent)

    # ---- the prefix of a request that frees its KV ---------------------------------
    def score_chain(self, request: Request) -> None:
        """Score every cached page of the request's computed prefix (call before its
        tables are freed: pages still held take their benefit when they become free)."""
        bs = self.block_size
        n = min(len(request.block_hashes), request.num_computed_tokens // bs)
        if n == 0:
            return
        hashes = request.block_hashes[:n]
        full = [self._column(a, request, hashes) for a in self.full]
        windows = [self._column(a, request, hashes) for a in self.windows]
        ckpts = [[a.checkpoint_at(request, j) for j in range(1, n + 1)] for a in self.recurrent]
        points = self._hit_points(full, windows, ckpts, n)
        # S of each segment (hit point p_k, blocks since p_{k-1}), then the running max
        # from the deepest: a segment never ranks below one hanging from it
        lo, values, cost_lo = 0, [], 0.0
        reach = [a.window - 1 for a in self.windows]  # a query at t reads from t - reach
        for hi in points:
            pages = (hi - lo) * len(full) + self.checkpoint_pages
            pages += sum(hi - max(lo, max(0, hi * bs - r) // bs) for r in reach)
            cost_hi = self.cost(hi * bs)
            values.append((cost_hi - cost_lo) / pages)
            lo, cost_lo = hi, cost_hi
        for k in range(len(values) - 2, -1, -1):
            values[k] = max(values[k], values[k + 1])
        # the value of each block index for full attention (its segment's), 0 past p_K
        by_block = [0.0] * n
        lo = 0
        for hi, value in zip(points, values, strict=True):
            by_block[lo:hi] = [value] * (hi - lo)
            lo = hi
        for a, col in zip(self.full, full, strict=True):
            _score(a.pool, zip(col, by_block), True)
        for a, col in zip(self.windows, windows, strict=True):
            _score(a.pool, zip(col, self._window_values(a, points, values, n)), False)
        at = dict(zip(points, values, strict=True))
        for a, col in zip(self.recurrent, ckpts, strict=True):
            _score(a.pool, ((p, at.get(j, 0.0)) for j, pages in enumerate(col, 1)
                            for p in pages or ()), True)

    def _column(self, alloc: FullAttentionAllocator, request: Request,
                hashes: list) -> list[KVBlock | None]:
        """The cached block of each of the prefix's blocks in `alloc`'s group (None: not
        cached): the request's own where it holds the cached one, else by key."""
        table = alloc.req_to_blocks.get(request.request_id, [])
        get, key = alloc.pool.get_cached_block, alloc.key
        col: list[KVBlock | None] = []
        for j, h in enumerate(hashes):
            b = table[j] if j < len(table) else NULL_BLOCK
            # a held block with a hash is the cached one of its index (published there,
            # or a hit matched there)
            col.append(b if b is not NULL_BLOCK and b.block_hash is not None else get(key(h)))
        return col

    def _hit_points(self, full: list, windows: list, ckpts: list, n: int) -> list[int]:
        """The block counts j at which a hit can end (`find_cached_prefix`'s rule)."""
        bs = self.block_size
        run = min((_leading(col) for col in full), default=n)
        # per window group: misses among its first j blocks, and how far back it reads
        misses = [(list(itertools.accumulate((b is None for b in c), initial=0)), a.window - 1)
                  for a, c in zip(self.windows, windows, strict=True)]
        return [
            j for j in range(1, run + 1)
            if all(m[j] == m[max(0, j * bs - r) // bs] for m, r in misses)
            and all(col[j - 1] is not None for col in ckpts)
        ]

    def _window_values(self, alloc: SlidingWindowAllocator, points: list[int],
                       values: list[float], n: int) -> list[float]:
        """Per block index: the value of the first hit point after it whose query reads
        it (a shallower one would have claimed it), 0 if none reads it."""
        out = [0.0] * n
        lo = 0
        for hi, value in zip(points, values, strict=True):
            start = max(lo, alloc.first_needed_block(hi * self.block_size))
            out[start:hi] = [value] * (hi - start)
            lo = hi
        return out

    # ---- pages a running request publishes -------------------------------------------
    def provisional(self, request: Request, tables: Sequence[list[KVBlock]], first: int,
                    last: int) -> None:
        """Score the pages the request just published: blocks [first, last) of its
        attention `tables` (per group, in allocator order) and the checkpoints its step
        writes, as the end of the prefix so far."""
        bs = self.block_size
        if last > first:
            value = self.segment_value(self._previous_point(request, last), last)
            for table in tables:
                for b in table[first:last]:
                    if b is not NULL_BLOCK and b.block_hash is not None:
                        b.benefit = value
        for a in self.recurrent:
            seq = a.seqs.get(request.request_id)
            for ckpt in seq.pending if seq is not None else ():
                j = ckpt.num_tokens // bs
                value = self.segment_value(self._previous_point(request, j), j)
                for p in ckpt.pages:
                    p.benefit = value

    def segment_value(self, lo: int, hi: int) -> float:
        """S of a segment from hit point `lo` to `hi` (block counts) of a whole prefix."""
        bs = self.block_size
        span = hi - lo
        pages = span * len(self.full) + self.checkpoint_pages
        pages += sum(min(span, hi - a.first_needed_block(hi * bs)) for a in self.windows)
        return (self.cost(hi * bs) - self.cost(lo * bs)) / max(1, pages)

    def _previous_point(self, request: Request, j: int) -> int:
        """The hit point before block boundary j a prefix like the request's has: the
        previous block without recurrent groups, else the previous kept checkpoint (an
        interval one or the prompt end)."""
        if not self.recurrent:
            return max(0, j - 1)
        interval = self.recurrent[0].policy.interval_blocks
        prompt_end = (request.num_prompt_tokens - 1) // self.block_size
        kept = (j - 1) // interval * interval
        return max(kept, prompt_end if prompt_end < j else 0)


def _score(pool: BlockPool, pages, used_now: bool) -> None:
    """Set the benefit of (page, value) pairs; a free page's priority through
    `BlockPool.rescore`, a held one's when it becomes free."""
    for page, value in pages:
        if page is None:
            continue
        if page.entry >= 0:
            pool.rescore(page, value, used_now)
        else:
            page.benefit = value


def _leading(col: list[KVBlock | None]) -> int:
    """The length of the leading run of cached blocks."""
    for j, b in enumerate(col):
        if b is None:
            return j
    return len(col)
