"""The connector's scheduler side: external hits, what to load, what to save, finishing.

Pure Python (no device import). The scheduler calls, in order:

1. `num_external_tokens(request, num_device_tokens)` when admitting a request, after its
   device prefix-cache hit: how many further tokens the tiers can supply. Loads are
   always asynchronous: the scheduler allocates blocks for them, calls
   `start_load(request, tables, num_device_tokens, num_external_tokens)` with the
   request's block table of every KV group, and parks the request until the load
   reports. A block whose save is still in flight counts as held by the first durable
   tier, a block the device just evicted as held by the host (the worker writes them
   before it runs a load queued later). The cost model (cost.py) may cut the hit
   short: blocks that would load slower than they compute are recomputed.
2. `build_step_meta(scheduled)` once per step: the loads to start, the blocks the
   device evicted (to move into the host tier, placement.py), prefetches, and the
   blocks the step fills, to save to the durable tiers after its forward pass. A block
   whose object is being saved or is already in the first durable tier is not saved
   again; a stack with no durable tier saves nothing (its host holds what the device
   evicts).
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
the request gives its blocks back and is admitted again from its device hit
(`LoadOutcome.restart`); its new lookup no longer finds the objects that failed (a
corrupt one is deleted), so it loads the longest prefix still whole, and after a second
failure it computes the rest without loading.

Recurrent groups (LINEAR: state slots and checkpoints, core/kv/recurrent.py): a
checkpoint's pages are objects of the same format, and a hit of n blocks needs every
page of each recurrent group's checkpoint after block n; saves, lookups and loads of
them are in checkpoints.py. To the code here such a group is a window of zero length
(it needs no block of its own before n). MLA groups are full attention here.

Sessions. A request may name its session (OpenAI `user` / `session_id`, Anthropic
`metadata.user_id`). A turn that ended in a tool call (`session_returns`) says the session
will be back: when its next turn arrives (`request_arrived`), the blocks of its prompt
that only a durable tier holds are prefetched into the host, in the background, while
the turn waits for admission. Any request that waits for admission gets the same
(`prefetch`, called by the scheduler for the waiting requests it could not admit), so
its load starts while earlier requests compute. Writing a session's KV down early needs
no hint: saves are write-through to the durable tiers as blocks fill.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.engine.request import Request
from tokenmill.kv.block_pool import NULL_BLOCK
from tokenmill.kv.groups import KVGroup
from tokenmill.kv_connector.checkpoints import CheckpointObjects
from tokenmill.kv_connector.cost import LoadCostModel
from tokenmill.kv_connector.directory import TierDirectory
from tokenmill.kv_connector.objects import ObjectKey, object_key
from tokenmill.kv_connector.placement import HostPlacement
from tokenmill.kv_connector.stack import TierStack
from tokenmill.platforms.interfaces import AttentionKind
from tokenmill.platforms.kv_messages import (
    BlockTransfer,
    ConnectorStepMeta,
    LoadJob,
    LoadResult,
    WorkerReport,
)

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
        # per group: its sliding window in tokens, None for full attention (and MLA), 0
        # for a recurrent group (no block of its own: its checkpoint, `self.checkpoints`)
        self.windows: list[int | None] = [
            g.sliding_window if g.kind == AttentionKind.SLIDING_WINDOW
            else 0 if g.kind == AttentionKind.LINEAR else None
            for g in groups or ()
        ] or [None]
        self.checkpoints = CheckpointObjects(fingerprint, groups)
        self._block_groups = [g for g in range(len(self.windows)) if g not in self.checkpoints.pages]
        # tokens are counted once per block position, on a full-attention group's objects
        self._token_group = next((g for g, w in enumerate(self.windows) if w is None), 0)
        self._loads: dict[str, _Load] = {}
        self._saving: set[ObjectKey] = set()
        self._pending_lookup: dict[str, dict[tuple[int, int], str | None]] = {}
        # requests whose load failed and restarted -> how often; at _MAX_RESTARTS they
        # compute (a failed object was deleted, so the next lookup finds a shorter hit)
        self._no_load: dict[str, int] = {}
        self._returning: OrderedDict[str, None] = OrderedDict()  # sessions hinted to return
        self.num_prefetched = 0  # objects prefetches copied up (reported by the worker)
        # the host tier as the device pool's victim cache (evictions, prefetches, pins)
        self.placement = HostPlacement(fingerprint, stack.host_name, stack.host_objects)
        self.cost = LoadCostModel(stack.object_bytes, block_size)
        self._save_tier = stack.save_tier  # the first durable tier (None: saves go nowhere)
        self._cost_counted: set[str] = set()  # requests whose recompute choice is counted
        self._pool = None  # the device pool, with a host tier (`attach`)

    def attach(self, pool) -> None:
        """Hear of the device pool's evictions (`BlockPool.evict_listener`): with a host
        tier, each evicted block moves there."""
        if self.placement.host is not None:
            pool.evict_listener = self.placement.evicted
            self._pool = pool

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
        if (request.sampling_params.prompt_logprobs is not None
                or self._no_load.get(rid, 0) >= self._MAX_RESTARTS):
            return 0  # every prompt position must be computed to score it
        bs = self.block_size
        start = num_device_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if end <= start:
            return 0
        wanted = [(g, p) for p in range(start, end) for g in self._block_groups]
        keys = [self.key(request.block_hashes[p], g) for g, p in wanted]
        where = self.stack.locate(keys)
        # A key whose save is in flight is as good as held: its pages were copied out when
        # the block filled, and the worker runs saves and loads on one thread in order, so
        # the write lands before a load queued after it reads the key. Without this, a
        # block the device evicts while the save thread is behind (a busy machine) is
        # recomputed although its bytes are on their way to the host.
        where = [self._in_flight_to(k) if w is None else w for k, w in zip(keys, where)]
        found = dict(zip(wanted, where))
        on_device = self._device_copies(request, found)
        # full attention bounds the hit by its leading run; windows may shorten it further,
        # and recurrent groups to a boundary with a whole checkpoint
        n = end
        for g, w in enumerate(self.windows):
            if w is None:
                n = next((p for p in range(start, n) if found[(g, p)] is None), n)
        n = start + self._worth_loading(request, found, start, n)
        ckpts = (self.checkpoints.lookup(self.stack, request, start, n, self._in_flight_to)
                 if self.checkpoints else {})
        while n > start and (
            any(found[gp] is None for gp in self._needed(start, n))
            or (self.checkpoints and not self.checkpoints.whole(ckpts, n))
        ):
            n -= 1
        if n == start:
            self.placement.release(rid)  # it computes: its prefetched objects may go
            return 0
        for gp in self._needed(start, n):  # copied into the host before the load reads
            if gp in on_device:
                self.placement.evicted(on_device[gp])
        if self.checkpoints:  # page p of group g's checkpoint at n: entry (g, -1 - p)
            pages = dict.fromkeys(self.checkpoints.pages, 0)
            for (g, _), tier in zip(self.checkpoints.keys(request, n), ckpts[n], strict=True):
                pages[g] += 1
                found[(g, -pages[g])] = tier
        self._pending_lookup[rid] = found
        return (n - start) * bs

    def _device_copies(self, request: Request, found: dict) -> dict:
        """Blocks no tier holds that the device pool still caches, beyond the device hit
        (a hybrid model's hit ends at a recurrent checkpoint, so cached attention blocks
        may lie past it): with exclusive placement the host lacks them, so each counts as
        the host's (marked in `found`), and the caller queues the copy of those its load
        needs (the worker copies them into the host before it starts the step's loads).
        Returns (group, block) -> the cached KVBlock."""
        if self._pool is None:
            return {}
        out = {}
        for (g, p), tier in found.items():
            if tier is None:
                block_hash = request.block_hashes[p]
                block = self._pool.get_cached_block(
                    block_hash if g == 0 else block_hash + b"/g%d" % g)
                if block is not None:
                    out[(g, p)] = block
                    found[(g, p)] = self.placement.host
        return out

    def _in_flight_to(self, key: ObjectKey) -> str | None:
        """The tier an object no tier holds yet is on its way to: a block whose save is
        in flight counts as held by the first durable tier, an evicted block by the host
        (the worker runs saves and loads on one thread in order, and moves evicted blocks
        into the host before it starts a step's loads). Without this, a block the device
        evicts while the save thread is behind (a busy machine) is recomputed although
        its bytes are on their way."""
        if key in self._saving:
            return self._save_tier
        return self.placement.host if self.placement.arriving(key) else None

    def _worth_loading(self, request: Request, found: dict, start: int, end: int) -> int:
        """How many of blocks [start, end), all held by some tier, the cost model says to
        load rather than recompute; the rest are counted per tier as chosen recomputes."""
        positions = [[found[(g, p)] for g in self._block_groups if found.get((g, p))]
                     for p in range(start, end)]
        k = self.cost.blocks_to_load(positions)
        rid = request.request_id
        if start + k < end and rid not in self._cost_counted:
            self._cost_counted.add(rid)
            for p in range(start + k, end):
                tier = found.get((self._token_group, p))
                if tier is not None:
                    self.stack.count(tier, tokens_recompute_chosen=self.block_size)
        return k

    def start_load(
        self, request: Request, tables: list[list[int]], num_device_tokens: int, num_tokens: int
    ) -> None:
        """Queue the load of `num_tokens` external tokens into the request's blocks that
        follow its `num_device_tokens` device-hit tokens. `tables`: the request's block
        table of each group (a window's blocks outside the hit's window already given
        back; a recurrent group's: the pages its checkpoint at the end is loaded into)."""
        bs = self.block_size
        first, n = num_device_tokens // bs, (num_device_tokens + num_tokens) // bs
        found = self._pending_lookup.pop(request.request_id, {})
        needed = self._needed(first, n)
        blocks = [
            BlockTransfer(tables[g][p], self.key(request.block_hashes[p], g)) for g, p in needed
        ]
        tiers = [(g, found.get((g, p))) for g, p in needed]
        if self.checkpoints:  # the recurrent groups' checkpoint at n, last
            pages = dict.fromkeys(self.checkpoints.pages, 0)
            for g, transfer in self.checkpoints.load_blocks(request, tables, n):
                pages[g] += 1
                blocks.append(transfer)
                tiers.append((g, found.get((g, -pages[g]))))
        self._loads[request.request_id] = _Load(
            LoadJob(request.request_id, blocks), num_device_tokens, tiers
        )

    _MAX_SESSIONS = 65536  # hints kept, oldest dropped first
    # loads a request may restart after (a restarted one looks the tiers up again: the
    # corrupt objects are gone, so it loads the longest prefix still whole)
    _MAX_RESTARTS = 2

    def session_returns(self, session_id: str) -> None:
        """The session's last turn ended in a tool call: prefetch its next turn."""
        self._returning[session_id] = None
        self._returning.move_to_end(session_id)
        while len(self._returning) > self._MAX_SESSIONS:
            self._returning.popitem(last=False)

    def request_arrived(self, request: Request, num_device_tokens: int = 0) -> None:
        """A new request; with `request.block_hashes` filled and its device hit. Queues
        the prefetch of its prompt's blocks after it if its session was hinted to return."""
        sid = request.session_id
        if sid is None or sid not in self._returning:
            return
        del self._returning[sid]
        self.prefetch(request, num_device_tokens)

    def prefetch(self, request: Request, num_device_tokens: int) -> None:
        """Queue the copy into the host of the request's blocks after its device hit
        that only durable tiers hold (and of the latest whole recurrent checkpoint), once
        per request, pinned there for it until it is admitted or finishes."""
        if self.placement.host is None or self.placement.prefetched(request.request_id):
            return
        first = num_device_tokens // self.block_size
        keys = [self.key(h, g) for h in request.block_hashes[first:] for g in self._block_groups]
        if self.checkpoints and len(request.block_hashes) > first:
            ckpts = self.checkpoints.lookup(self.stack, request, first, len(request.block_hashes))
            last = max((j for j in ckpts if self.checkpoints.whole(ckpts, j)), default=0)
            if last:
                keys.extend(k for _, k in self.checkpoints.keys(request, last))
        host = self.placement.host
        durable = [k for k, w in zip(keys, self.stack.locate(keys)) if w not in (None, host)]
        self.placement.prefetch(request.request_id, durable)

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loads

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def build_step_meta(
        self,
        scheduled: list[tuple[Request, list[list[int]], int, int]],
        checkpoint_saves: list[tuple[bytes, int]] = (),
    ) -> ConnectorStepMeta:
        """`scheduled`: (request, its block table of each group, first token computed,
        tokens computed) for each request in the step. `checkpoint_saves`: (prefix-cache
        key, block id) of the kept recurrent checkpoint pages the step writes
        (`KVCacheManager.checkpoint_saves`)."""
        meta = ConnectorStepMeta()
        self.placement.fill(meta)
        for load in self._loads.values():
            if not load.started:
                load.started = True
                meta.loads.append(load.job)
        bs = self.block_size
        for request, tables, start, num_new in scheduled if self._save_tier else ():
            for g, table in enumerate(tables):
                if g in self.checkpoints.pages:
                    continue  # a state slot: never an object (checkpoints are, below)
                end = min((start + num_new) // bs, len(request.block_hashes), len(table))
                for i in range(start // bs, end):
                    if self.windows[g] is not None and table[i] == NULL_BLOCK.block_id:
                        continue  # a window's block it no longer holds (a pool with
                        # windows reserves id 0 for the null block; a plain one uses it)
                    key = self.key(request.block_hashes[i], g)
                    if key in self._saving or self.stack.durable_holds(key):
                        continue
                    self._saving.add(key)
                    meta.saves.append(BlockTransfer(table[i], key))
        for transfer in self.checkpoints.saves(list(checkpoint_saves) if self._save_tier else []):
            if transfer.key not in self._saving and not self.stack.durable_holds(transfer.key):
                self._saving.add(transfer.key)
                meta.saves.append(transfer)
        meta.saves.extend(self.checkpoints.take_unsent())  # held: in `_saving` already
        self._pending_lookup.clear()
        return meta

    def process_report(self, report: WorkerReport) -> list[LoadOutcome]:
        if isinstance(self.stack, TierDirectory):
            self.stack.apply(report)  # first: the counts below land on its fresh counters
        self.num_prefetched += report.num_prefetched
        self.placement.reported(report)
        self.cost.observe_step(report.step_tokens, report.step_seconds)
        for result in report.loads:
            self.cost.observe_load(result.tier_bytes, result.tier_seconds)
            self.placement.release(result.request_id)
        for key in (*report.saved_keys, *report.failed_save_keys):
            self._saving.discard(key)
            self.checkpoints.save_ended(key)
        return [o for o in map(self._load_ended, report.loads) if o is not None]

    def _load_ended(self, result: LoadResult) -> LoadOutcome | None:
        load = self._loads.pop(result.request_id, None)
        if load is None:
            return None
        bs = self.block_size
        # several groups (or checkpoints) and a failure: nothing of the load is kept
        restart = result.num_loaded < result.num_requested and (
            len(self.windows) > 1 or bool(self.checkpoints))
        kept = 0 if restart else result.num_loaded
        for (g, _), tier_name in zip(load.tiers[:kept], result.tiers):
            if g == self._token_group:
                self.stack.count(tier_name, tokens_loaded=bs)
        for g, promised in load.tiers[kept:]:
            if promised is not None and g == self._token_group:
                self.stack.count(promised, tokens_recomputed=bs)
        num_blocks = sum(1 for g, _ in load.tiers if g == self._token_group)
        if result.num_loaded == result.num_requested:
            return LoadOutcome(result.request_id, load.num_device_tokens + num_blocks * bs, 0)
        logger.warning(
            "KV load for %s stopped at object %d of %d; recomputing from there",
            result.request_id, result.num_loaded, result.num_requested,
        )
        if restart:
            self._no_load[result.request_id] = self._no_load.get(result.request_id, 0) + 1
            return LoadOutcome(result.request_id, 0, num_blocks * bs, restart=True)
        return LoadOutcome(
            result.request_id,
            load.num_device_tokens + result.num_loaded * bs,
            (result.num_requested - result.num_loaded) * bs,
        )

    def save_rolling_checkpoints(self, pages: list) -> list:
        """A finishing or preempted request's rolling checkpoint `pages` (KVBlocks the
        scheduler holds, `KVCacheManager.hold_rolling_checkpoints`): saved with the next
        step. Returns the pages to release now (already saved or being saved); the
        others come back from `take_released` once the worker reports their save."""
        if not self._save_tier:  # no durable tier: evicted, they move to the host
            return list(pages)

        def skip(key: ObjectKey) -> bool:
            if key in self._saving or self.stack.durable_holds(key):
                return True
            self._saving.add(key)
            return False
        return self.checkpoints.hold(pages, skip)

    def take_released(self) -> list:
        """Held checkpoint pages whose save ended (see `save_rolling_checkpoints`)."""
        return self.checkpoints.take_released()

    @property
    def has_unsent_saves(self) -> bool:
        """Held saves, evicted blocks or prefetch changes wait for a step to carry them
        (the engine runs one)."""
        return self.checkpoints.has_unsent or self.placement.has_unsent

    @property
    def holds_blocks(self) -> bool:
        """Held pages wait for a worker report (a step brings it)."""
        return self.checkpoints.num_held > 0

    def request_finished(self, request: Request) -> bool:
        """True: keep the request's blocks until a report ends its load (the worker may
        still be writing into them); False: free them now. Saves never hold blocks: the
        worker copies a block out during the step that fills it."""
        self._no_load.pop(request.request_id, None)
        self._cost_counted.discard(request.request_id)
        self.placement.forget(request.request_id)
        load = self._loads.get(request.request_id)
        if load is not None and not load.started:
            del self._loads[request.request_id]  # never sent: nothing writes into the blocks
            return False
        return load is not None
