"""The connector's scheduler side: external hits, what to load, what to save, finishing.

Pure Python (no device import). The scheduler calls, in order:

1. `num_external_tokens(request, num_device_tokens)` when admitting a request, after its
   device prefix-cache hit: how many further tokens the tiers can supply. Loads are
   always asynchronous: the scheduler allocates blocks for them, calls
   `start_load(request, tables, num_device_tokens, num_external_tokens)` with the
   request's block table of every KV group, and parks the request until the load
   reports. A block whose save is still in flight counts as held (the worker writes it
   before it runs a load queued later).
2. `build_step_meta(scheduled)` once per step: the loads to start and the blocks the
   step fills, to save after its forward pass. A block whose object is being saved or
   is already in the fastest tier is not saved again.
3. `process_report(report)` with each worker report: returns the requests whose loads
   ended and how many of their external tokens arrived (a failed or corrupt block cuts
   the load there; the scheduler recomputes only from that point).
4. `request_finished(request)` when a request stops: True when its blocks must stay
   allocated until a report releases them (a load is still writing into them).

KV groups (core/kv/groups.py: Gemma 3's and gpt-oss's sliding-window layers beside full
attention). Each group's block is its own object, keyed by the block hash tagged with the
group (the prefix cache's own per-group key), in the same format: the block's page in
every arena slot, which that group's layers own. A hit of n blocks needs every block
before n of each full-attention group, and of a sliding-window group only the blocks its
window reads at n (`_first_needed`); the scheduler gives the window blocks the load
skips back to the pool before the load starts. A load that fails part-way in a model of
several groups cannot keep a prefix (a window's skipped blocks are holes before it):
the request gives its blocks back and is admitted again from its device hit, computing
the rest (`LoadOutcome.restart`), without a second load.

Sessions. A request may name its session (OpenAI `user` / `session_id`, Anthropic
`metadata.user_id`). A turn that ended in a tool call (`session_returns`) says the session
will be back: when its next turn arrives (`request_arrived`), the blocks of its prompt
that only a slower tier holds are prefetched into the fastest one, in the background,
while the turn waits for admission. Writing a session's KV down early needs no hint:
saves are write-through as blocks fill, so an idle session's KV is already in every tier
before the device evicts it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.kv.block_pool import NULL_BLOCK
from tokenmill.kv.groups import KVGroup
from tokenmill.kv_connector.directory import TierDirectory
from tokenmill.kv_connector.messages import (
    BlockTransfer,
    ConnectorStepMeta,
    LoadJob,
    LoadResult,
    WorkerReport,
)
from tokenmill.kv_connector.objects import ObjectKey, object_key
from tokenmill.kv_connector.stack import TierStack
from tokenmill.platforms.interfaces import AttentionKind
from tokenmill.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Load:
    job: LoadJob
    num_device_tokens: int
    # per block of the job: its group and where the lookup found it
    tiers: list[tuple[int, str | None]]
    started: bool = False


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    request_id: str
    num_computed_tokens: int  # device hit + the external tokens that arrived
    num_failed_tokens: int  # external tokens promised but not loaded (to recompute)
    # several KV groups and a failed load: give the blocks back and admit it again
    restart: bool = False


class KVConnectorScheduler:
    """`stack`: the worker's own TierStack when it runs in this process ("uni"), else the
    TierDirectory mirroring it from the worker's reports ("mp"). `groups`: the engine's KV
    groups (None: one full-attention group, a plain model)."""

    def __init__(
        self,
        stack: TierStack | TierDirectory,
        fingerprint: bytes,
        block_size: int,
        groups: tuple[KVGroup, ...] | None = None,
    ) -> None:
        self.stack = stack
        self.fingerprint = fingerprint
        self.block_size = block_size
        # per group: its sliding window in tokens, None for full attention
        self.windows: list[int | None] = [
            g.sliding_window if g.kind == AttentionKind.SLIDING_WINDOW else None
            for g in groups or ()
        ] or [None]
        # tokens are counted once per block position, on a full-attention group's objects
        self._token_group = next((g for g, w in enumerate(self.windows) if w is None), 0)
        self._loads: dict[str, _Load] = {}
        self._saving: set[ObjectKey] = set()
        self._pending_lookup: dict[str, dict[tuple[int, int], str | None]] = {}
        self._no_load: set[str] = set()  # requests whose load failed: they compute
        self._returning: OrderedDict[str, None] = OrderedDict()  # sessions hinted to return
        self._prefetch: list[ObjectKey] = []
        self.num_prefetched = 0  # objects prefetches copied up (reported by the worker)

    def key(self, block_hash: bytes, group: int = 0) -> ObjectKey:
        """The object key of group `group`'s block with this hash (the prefix cache's
        per-group key, FullAttentionAllocator.key, under the layout fingerprint)."""
        return object_key(self.fingerprint, block_hash if group == 0 else block_hash + b"/g%d" % group)

    def _first_needed(self, group: int, num_tokens: int) -> int:
        """The first block a query at position `num_tokens` reads in `group`."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_tokens - window + 1) // self.block_size

    def _needed(self, first: int, n: int) -> list[tuple[int, int]]:
        """(group, block) pairs a hit of `n` blocks needs beyond the device's `first`."""
        return [
            (g, p) for p in range(first, n) for g in range(len(self.windows))
            if p >= self._first_needed(g, n * self.block_size)
        ]

    def num_external_tokens(self, request: Request, num_device_tokens: int) -> int:
        """Tokens after the first `num_device_tokens` (a whole number of blocks) that the
        tiers hold, in whole blocks, leaving at least one token to compute."""
        rid = request.request_id
        if request.sampling_params.prompt_logprobs is not None or rid in self._no_load:
            return 0  # every prompt position must be computed to score it
        bs = self.block_size
        start = num_device_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if end <= start:
            return 0
        wanted = [(g, p) for p in range(start, end) for g in range(len(self.windows))]
        keys = [self.key(request.block_hashes[p], g) for g, p in wanted]
        where = self.stack.locate(keys)
        # A key whose save is in flight is as good as held: its pages were copied out when
        # the block filled, and the worker runs saves and loads on one thread in order, so
        # the write lands before a load queued after it reads the key. Without this, a
        # block the device evicts while the save thread is behind (a busy machine) is
        # recomputed although its bytes are on their way to the host.
        fastest = self._fastest_tier()
        where = [
            w if w is not None or k not in self._saving else fastest
            for k, w in zip(keys, where)
        ]
        found = dict(zip(wanted, where))
        # full attention bounds the hit by its leading run; windows may shorten it further
        n = end
        for g, w in enumerate(self.windows):
            if w is None:
                n = next((p for p in range(start, n) if found[(g, p)] is None), n)
        while n > start and any(found[gp] is None for gp in self._needed(start, n)):
            n -= 1
        if n == start:
            return 0
        self._pending_lookup[rid] = found
        return (n - start) * bs

    def _fastest_tier(self) -> str | None:
        """The tier a save in flight writes first (None: the stack has no tier)."""
        names = (
            self.stack.tier_names if isinstance(self.stack, TierDirectory)
            else [t.name for t in self.stack.tiers]
        )
        return names[0] if names else None

    def start_load(
        self, request: Request, tables: list[list[int]], num_device_tokens: int, num_tokens: int
    ) -> None:
        """Queue the load of `num_tokens` external tokens into the request's blocks that
        follow its `num_device_tokens` device-hit tokens. `tables`: the request's block
        table of each group (a window's blocks outside the hit's window already given
        back)."""
        bs = self.block_size
        first, n = num_device_tokens // bs, (num_device_tokens + num_tokens) // bs
        found = self._pending_lookup.pop(request.request_id, {})
        needed = self._needed(first, n)
        blocks = [
            BlockTransfer(tables[g][p], self.key(request.block_hashes[p], g)) for g, p in needed
        ]
        self._loads[request.request_id] = _Load(
            LoadJob(request.request_id, blocks), num_device_tokens,
            [(g, found.get((g, p))) for g, p in needed],
        )

    _MAX_SESSIONS = 65536  # hints kept, oldest dropped first

    def session_returns(self, session_id: str) -> None:
        """The session's last turn ended in a tool call: prefetch its next turn."""
        self._returning[session_id] = None
        self._returning.move_to_end(session_id)
        while len(self._returning) > self._MAX_SESSIONS:
            self._returning.popitem(last=False)

    def request_arrived(self, request: Request) -> None:
        """A new request; with `request.block_hashes` filled. Queues the prefetch of its
        prompt's blocks if its session was hinted to return."""
        sid = request.session_id
        if sid is None or sid not in self._returning:
            return
        del self._returning[sid]
        self._prefetch.extend(
            self.key(h, g) for h in request.block_hashes for g in range(len(self.windows))
        )

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loads

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def build_step_meta(
        self, scheduled: list[tuple[Request, list[list[int]], int, int]]
    ) -> ConnectorStepMeta:
        """`scheduled`: (request, its block table of each group, first token computed,
        tokens computed) for each request in the step."""
        meta = ConnectorStepMeta(prefetch=self._prefetch)
        self._prefetch = []
        for load in self._loads.values():
            if not load.started:
                load.started = True
                meta.loads.append(load.job)
        bs = self.block_size
        for request, tables, start, num_new in scheduled:
            for g, table in enumerate(tables):
                end = min((start + num_new) // bs, len(request.block_hashes), len(table))
                for i in range(start // bs, end):
                    if self.windows[g] is not None and table[i] == NULL_BLOCK.block_id:
                        continue  # a window's block it no longer holds (a pool with
                        # windows reserves id 0 for the null block; a plain one uses it)
                    key = self.key(request.block_hashes[i], g)
                    if key in self._saving or self.stack.fastest_holds(key):
                        continue
                    self._saving.add(key)
                    meta.saves.append(BlockTransfer(table[i], key))
        self._pending_lookup.clear()
        return meta

    def process_report(self, report: WorkerReport) -> list[LoadOutcome]:
        if isinstance(self.stack, TierDirectory):
            self.stack.apply(report)  # first: the counts below land on its fresh counters
        self.num_prefetched += report.num_prefetched
        for key in report.saved_keys:
            self._saving.discard(key)
        for key in report.failed_save_keys:
            self._saving.discard(key)
        return [o for o in map(self._load_ended, report.loads) if o is not None]

    def _load_ended(self, result: LoadResult) -> LoadOutcome | None:
        load = self._loads.pop(result.request_id, None)
        if load is None:
            return None
        bs = self.block_size
        for (g, _), tier_name in zip(load.tiers, result.tiers):
            if g == self._token_group:
                self.stack.count(tier_name, tokens_loaded=bs)
        for g, promised in load.tiers[result.num_loaded :]:
            if promised is not None and g == self._token_group:
                self.stack.count(promised, tokens_recomputed=bs)
        num_blocks = sum(1 for g, _ in load.tiers if g == self._token_group)
        if result.num_loaded == result.num_requested:
            return LoadOutcome(result.request_id, load.num_device_tokens + num_blocks * bs, 0)
        logger.warning(
            "KV load for %s stopped at object %d of %d; recomputing from there",
            result.request_id, result.num_loaded, result.num_requested,
        )
        if len(self.windows) > 1:
            self._no_load.add(result.request_id)
            return LoadOutcome(result.request_id, 0, num_blocks * bs, restart=True)
        return LoadOutcome(
            result.request_id,
            load.num_device_tokens + result.num_loaded * bs,
            (result.num_requested - result.num_loaded) * bs,
        )

    def request_finished(self, request: Request) -> bool:
        """True: keep the request's blocks until a report ends its load (the worker may
        still be writing into them); False: free them now. Saves never hold blocks: the
        worker copies a block out during the step that fills it."""
        self._no_load.discard(request.request_id)
        load = self._loads.get(request.request_id)
        if load is not None and not load.started:
            del self._loads[request.request_id]  # never sent: nothing writes into the blocks
            return False
        return load is not None
