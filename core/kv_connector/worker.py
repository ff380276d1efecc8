"""The connector's worker side: moves KV pages between the arena and the tiers.

Per step the runner calls `begin_step(meta)` before its forward pass and
`end_step(meta)` after it; `report()` then returns what finished. This is the whole API
a caller needs (prefill/decode handover included: a `LoadJob` names blocks by arena id and
object key, a `BlockTransfer` list saves them):

- `begin_step`: pins the host objects the step's loads will read; moves the blocks the
  device evicted into the host tier (`demote`: a synchronous copy, since the step may
  overwrite those pages); starts prefetches and loads in the background.
- `end_step`: copies the pages of the blocks the step filled out of the arena (the block
  may be reused by the next step) and leaves framing, checksum and the durable tiers'
  writes to the background thread.

Loads are batched per request: one job reads all its blocks, the host's straight from
the slab (checked in place, no copy), the disk's with `readinto` into staging rows by
several I/O threads (`DiskTier.read_into`), a remote's in one round trip, then scatters
each arena slot's rows in one indexed copy. The scheduler never computes on a loading
request's blocks until the load reports, so the thread and the model never touch the
same page. A block loaded from the host leaves it (the device holds it now).

Ordering contract (the scheduler side relies on it): loads, saves and prefetches run on
one background thread in the order they were sent, so a load sent after the save of a
block reads what the save wrote, even while the save was still pending when the load was
planned; the I/O threads work inside one job, which waits for them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from tokenmill.kv_connector.objects import HEADER_BYTES, KVLayout, ObjectKey
from tokenmill.kv_connector.stack import TierStack
from tokenmill.platforms.interfaces import Allocator
from tokenmill.platforms.kv_messages import (
    BlockTransfer,
    ConnectorStepMeta,
    EvictedBlock,
    LoadJob,
    LoadResult,
    PrefetchJob,
    WorkerReport,
)
from tokenmill.platforms.kv_tier import KVTier, TierUnavailableError

logger = logging.getLogger(__name__)

STAGING_BYTES = 32 << 20  # a load reads at most this much into staging at a time


def _flat_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every slot's [H, num_blocks, R] rows as one [total_rows, R] view of the buffer
    they share, and the row of block 0 of each (slot, half), in payload order; None when
    they are separate tensors or not R-aligned (then each slot half moves on its own)."""
    first = rows[0]
    halves, num_blocks, width = first.shape
    storage = first.untyped_storage()
    bases = []
    for r in rows:
        if (r.untyped_storage().data_ptr() != storage.data_ptr() or r.shape != first.shape
                or r.stride() != (num_blocks * width, width, 1) or r.storage_offset() % width):
            return None
        bases.extend(r.storage_offset() // width + h * num_blocks for h in range(halves))
    flat = torch.empty(0, dtype=torch.uint8, device=first.device)
    flat.set_(storage, 0, (storage.nbytes() // width, width), (width, 1))
    return flat, torch.tensor(bases, dtype=torch.int64)


class KVConnectorWorker:
    # Blocks copied out but not yet written: past this, new saves are dropped (reported as
    # failed, so recomputed if ever needed) rather than piling up host memory behind a
    # slow tier.
    MAX_PENDING_SAVE_BLOCKS = 4096

    def __init__(
        self, stack: TierStack, layout: KVLayout, staging_allocator: Allocator | None = None
    ) -> None:
        self.stack = stack
        self.layout = layout
        self._rows: list[torch.Tensor] = []  # per slot: uint8 [H, num_blocks, page // H]
        # every slot's rows as one [rows, page // H] view of the arena and the first row
        # of each (slot, half), when they share one buffer (KVArena.page_rows): a block's
        # whole payload then moves in one indexed copy instead of one per slot half
        self._flat: tuple[torch.Tensor, torch.Tensor] | None = None
        # one thread: jobs run in the order sent (the ordering contract above)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-connector")
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: set[Future] = set()
        self._lock = threading.Lock()
        self._staging_allocator = staging_allocator
        self._pending_save_blocks = 0
        self._dropped: list[bytes] = []  # saves refused for back-pressure, to report
        self._demoted: list[bytes] = []  # evicted blocks handled since the last report
        self._prefetch_pins: dict[str, list[ObjectKey]] = {}  # request -> pinned host keys
        # the engine mirrors the stack from another process: reports carry its changes
        self.mirrored = False
        rows = max(1, min(64, STAGING_BYTES // layout.object_bytes))
        # staging rows for loads from disk and remote tiers: from the platform's
        # host-staging allocator (pinned memory on a device platform: the copy into the
        # arena runs at link speed)
        nbytes = rows * layout.object_bytes
        self._staging_buffer = (
            staging_allocator.allocate(nbytes) if staging_allocator is not None
            else torch.empty(nbytes, dtype=torch.uint8)
        )
        self._staging = self._staging_buffer.view(rows, layout.object_bytes)

    def register_kv_caches(self, caches: list[torch.Tensor]) -> None:
        """Per-layer attention caches in the standard layout, [2, num_blocks, block_size,
        kv_heads, head_size] (one layer per arena slot)."""
        shapes = tuple((c.shape[0], *c.shape[2:]) for c in caches)
        if shapes != self.layout.layer_shapes:
            raise ValueError(f"KV caches of shapes {shapes} do not match the layout {self.layout}")
        self._rows = [c.view(torch.uint8).view(2, c.shape[1], -1) for c in caches]
        self._flat = _flat_rows(self._rows)

    def register_page_rows(self, rows: list[torch.Tensor]) -> None:
        """The arena's slots as bytes, [H, num_blocks, page // H] each (`KVArena.page_rows`):
        a block's object is rows [:, block] of every slot, whatever the block holds
        (attention KV, MLA latents, recurrent state pages)."""
        shapes = tuple((r.shape[0], r.shape[2]) for r in rows)
        if shapes != self.layout.layer_shapes or self.layout.itemsize != 1:
            raise ValueError(f"KV page rows of shapes {shapes} do not match the layout {self.layout}")
        self._rows = rows
        self._flat = _flat_rows(rows)

    # ---- one step ---------------------------------------------------------------------
    def begin_step(self, meta: ConnectorStepMeta) -> None:
        """Before the forward pass: pins, moves into the host, prefetches, loads."""
        host = self.stack.host
        pins = [[b.key for b in job.blocks] if host is not None else [] for job in meta.loads]
        if host is not None:
            for keys in pins:  # first: this step's evictions must not drop what they read
                host.pin(keys)
            for rid in meta.unpin:
                host.unpin(self._prefetch_pins.pop(rid, []))
            for job in meta.prefetch:
                self._prefetch_pins.setdefault(job.request_id, []).extend(job.keys)
                host.pin(job.keys)
        deferred = self.demote(meta.demotes)
        for job in meta.prefetch:
            self._submit(self._prefetch, job)
        for job, keys in zip(meta.loads, pins, strict=True):
            self._submit(self._load, job, keys)
        if deferred is not None:  # after the loads, which move pinned objects out
            self._submit(self._insert, *deferred)

    def end_step(self, meta: ConnectorStepMeta) -> None:
        """After the forward pass: copy out the blocks it filled, to save."""
        self.save(meta.saves)

    def start_loads(self, jobs: list[LoadJob]) -> None:
        """Loads alone (no evictions this step): `begin_step` with only `jobs`."""
        self.begin_step(ConnectorStepMeta(loads=jobs))

    # ---- evicted blocks into the host -------------------------------------------------
    def demote(self, blocks: list[EvictedBlock]):
        """Copy evicted blocks' pages into host slots now, framed and checksummed (the
        step may overwrite them); a block the host holds already is skipped. Blocks that
        find every slot pinned (by this step's loads, which will move those objects out)
        are copied aside: returns them as the arguments of an `_insert` to queue after
        the loads (None: none)."""
        host = self.stack.host
        if not blocks:
            return None
        self._demoted.extend(b.key for b in blocks)
        if host is None:
            return None
        slots = host.reserve([b.key for b in blocks], [b.benefit for b in blocks])
        moved = [(b, s) for b, s in zip(blocks, slots, strict=True) if s is not None]
        if moved:
            slot_ids = torch.tensor([s for _, s in moved], dtype=torch.int64)
            pages = self._gather([b.block_id for b, _ in moved])
            host.slab[:, HEADER_BYTES:].index_copy_(0, slot_ids, pages)
            self._seal(host, [b for b, _ in moved], [s for _, s in moved])
        late = [b for b, s in zip(blocks, slots, strict=True) if s is None and not host.contains(b.key)]
        if not late:
            return None
        return late, self._gather([b.block_id for b in late])

    def _seal(self, host, blocks: list[EvictedBlock], slots: list[int]) -> None:
        """Frame the payloads written into `slots` and make them held."""
        codec, slab = self.stack.codec, host.slab.numpy()
        for b, s in zip(blocks, slots, strict=True):
            slab[s, :HEADER_BYTES] = np.frombuffer(codec.header(b.key, slab[s, HEADER_BYTES:]),
                                                   dtype=np.uint8)
        keys = [b.key for b in blocks]
        host.seal(keys, slots)
        self.stack.count(host.name, bytes_written=len(blocks) * self.layout.object_bytes)
        self.stack.log_held(host.name, keys)

    def _insert(self, blocks: list[EvictedBlock], payloads: torch.Tensor) -> None:
        """Evicted blocks copied aside, into the host once the loads before freed room;
        those still without a slot are dropped (the durable tiers keep them)."""
        host = self.stack.host
        slots = host.reserve([b.key for b in blocks], [b.benefit for b in blocks])
        placed = [(i, s) for i, s in enumerate(slots) if s is not None]
        if not placed:
            return
        for i, s in placed:
            host.slab[s, HEADER_BYTES:].copy_(payloads[i])
        self._seal(host, [blocks[i] for i, _ in placed], [s for _, s in placed])

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """The payloads of arena blocks `block_ids`, [n, payload_bytes] in host memory."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        first = self._rows[0]
        if self._flat is not None:
            flat, bases = self._flat
            rows = (bases[None, :] + ids[:, None]).reshape(-1).to(flat.device)
            return flat.index_select(0, rows).cpu().view(len(block_ids), -1)
        out = torch.empty((len(block_ids), len(self._rows), first.shape[0], first.shape[2]),
                          dtype=torch.uint8)
        for slot, rows in enumerate(self._rows):
            for h in range(rows.shape[0]):
                out[:, slot, h] = rows[h].index_select(0, ids.to(rows.device)).cpu()
        return out.view(len(block_ids), -1)

    def _scatter(self, objects: torch.Tensor, rows_at: list[int], block_ids: list[int]) -> None:
        """Write the payload of object row `rows_at[i]` of `objects` ([m, object_bytes]:
        host slots or staging rows) into arena block `block_ids[i]`."""
        if not block_ids:
            return
        payloads = objects[:, HEADER_BYTES:]
        if rows_at == list(range(len(rows_at))):  # rows 0..n-1: a plain slice
            src = payloads[: len(rows_at)]
        else:
            src = payloads.index_select(0, torch.tensor(rows_at, dtype=torch.int64))
        ids = torch.tensor(block_ids, dtype=torch.int64)
        first = self._rows[0]
        if self._flat is not None:
            flat, bases = self._flat
            rows = (bases[None, :] + ids[:, None]).reshape(-1).to(flat.device)
            flat.index_copy_(0, rows, src.reshape(-1, flat.shape[1]).to(flat.device))
            return
        src = src.reshape(len(block_ids), len(self._rows), first.shape[0], first.shape[2])
        for slot, rows in enumerate(self._rows):
            for h in range(rows.shape[0]):
                rows[h].index_copy_(0, ids.to(rows.device), src[:, slot, h].to(rows.device))

    # ---- loads ------------------------------------------------------------------------
    def _load(self, job: LoadJob, pinned: list[ObjectKey]) -> LoadResult:
        try:
            return self._load_blocks(job)
        finally:
            if self.stack.host is not None:
                self.stack.host.unpin(pinned)

    def _load_blocks(self, job: LoadJob) -> LoadResult:
        n = len(job.blocks)
        got: list[str | None] = [None] * n  # the tier each block came from
        tier_bytes: dict[str, int] = {}
        tier_seconds: dict[str, float] = {}
        host = self.stack.host
        where = self.stack.locate([b.key for b in job.blocks])
        moved: list[ObjectKey] = []
        if host is not None:
            todo = [i for i in range(n) if where[i] == host.name]
            t0 = time.perf_counter()
            moved = self._load_from_host(job, todo, got)
            self._account(host, todo, got, tier_bytes, tier_seconds, time.perf_counter() - t0)
        for tier in self.stack.durable:
            todo = [i for i in range(n) if got[i] is None and where[i] is not None]
            if not todo:
                break
            t0 = time.perf_counter()
            self._load_from(tier, job, todo, got)
            self._account(tier, todo, got, tier_bytes, tier_seconds, time.perf_counter() - t0)
        num_loaded = next((i for i, t in enumerate(got) if t is None), n)
        if num_loaded == n:  # the device holds them now (a partial load may keep none)
            for key in moved:
                self.stack.delete(host, key)
        return LoadResult(job.request_id, num_loaded, n, [t for t in got[:num_loaded]],
                          tier_bytes, tier_seconds)

    def _account(self, tier: KVTier, todo: list[int], got: list, tier_bytes: dict,
                 tier_seconds: dict, seconds: float) -> None:
        hits = sum(1 for i in todo if got[i] == tier.name)
        if hits:
            tier_bytes[tier.name] = tier_bytes.get(tier.name, 0) + hits * self.layout.object_bytes
            tier_seconds[tier.name] = tier_seconds.get(tier.name, 0.0) + seconds
            self.stack.count(tier.name, hits=hits, bytes_read=hits * self.layout.object_bytes)

    def _load_from_host(self, job: LoadJob, todo: list[int], got: list) -> list[ObjectKey]:
        """Blocks `todo` from the host slab in place (pinned by the job), checked, then
        scattered; returns their keys, to drop from the host once the whole job loaded
        (the device holds them then)."""
        host = self.stack.host
        slab = host.slab
        rows_at, ids, keys = [], [], []
        for i in todo:
            key = job.blocks[i].key
            slot = host.slot_of(key)
            if slot is None or self.stack.checked(host, key, slab[slot].numpy()) is None:
                continue  # gone, or bad (deleted): a durable tier may still have it
            rows_at.append(slot)
            ids.append(job.blocks[i].block_id)
            keys.append(key)
            got[i] = host.name
        self._scatter(slab, rows_at, ids)
        return keys

    def _load_from(self, tier: KVTier, job: LoadJob, todo: list[int], got: list) -> None:
        """Blocks `todo` from a durable tier, a staging batch at a time."""
        size = self.layout.object_bytes
        staging = self._staging
        for start in range(0, len(todo), staging.shape[0]):
            batch = todo[start : start + staging.shape[0]]
            keys = [job.blocks[i].key for i in batch]
            bufs = [memoryview(staging[r].numpy()) for r in range(len(batch))]
            try:
                sizes = tier.read_into(keys, bufs)
            except TierUnavailableError:
                self.stack.count(tier.name, errors=1)
                return
            rows_at, ids, promoted = [], [], []
            for r, (i, key, stored) in enumerate(zip(batch, keys, sizes, strict=True)):
                if stored is None:
                    self.stack.count(tier.name, misses=1)
                    continue
                if stored != size:
                    self.stack.refuse(tier, key, f"{stored} bytes stored, objects are {size}")
                    continue
                if self.stack.checked(tier, key, bufs[r]) is None:
                    continue
                rows_at.append(r)
                ids.append(job.blocks[i].block_id)
                got[i] = tier.name
                promoted.append((key, bytes(bufs[r])))
            self._scatter(staging, rows_at, ids)
            faster = self.stack.durable[: self.stack.durable.index(tier)]
            for key, data in promoted if faster else ():
                self.stack.promote_durable(key, data, faster)

    # ---- prefetches -------------------------------------------------------------------
    def _prefetch(self, job: PrefetchJob) -> int:
        """Copy `job.keys` the host lacks from the durable tiers into host slots (read in
        place); they stay pinned for the request until the scheduler releases it."""
        host = self.stack.host
        if host is None:
            return 0
        wanted = [k for k in job.keys if not host.contains(k)]
        slots = host.reserve(wanted, [None] * len(wanted))
        todo = [(k, s) for k, s in zip(wanted, slots, strict=True) if s is not None]
        sealed = 0
        for tier in self.stack.durable:
            if not todo:
                break
            bufs = [memoryview(host.slab[s].numpy()) for _, s in todo]
            try:
                sizes = tier.read_into([k for k, _ in todo], bufs)
            except TierUnavailableError:
                self.stack.count(tier.name, errors=1)
                continue
            good, rest = [], []
            for (key, slot), buf, stored in zip(todo, bufs, sizes, strict=True):
                if stored is None:
                    rest.append((key, slot))
                    continue
                if stored != len(buf):
                    self.stack.refuse(tier, key, f"{stored} bytes stored, objects are {len(buf)}")
                    rest.append((key, slot))
                elif self.stack.checked(tier, key, buf) is None:
                    rest.append((key, slot))
                else:
                    good.append((key, slot))
            if good:
                host.seal([k for k, _ in good], [s for _, s in good])
                nbytes = len(good) * self.layout.object_bytes
                self.stack.count(tier.name, hits=len(good), bytes_read=nbytes)
                self.stack.count(host.name, bytes_promoted=nbytes)
                self.stack.log_held(host.name, [k for k, _ in good])
                sealed += len(good)
            todo = rest
        host.release([s for _, s in todo])
        return sealed

    # ---- saves ------------------------------------------------------------------------
    def save(self, saves: list[BlockTransfer]) -> None:
        """Copy the pages of `saves` out of the arena now; write them to the tiers later."""
        if not saves:
            return
        with self._lock:
            if self._pending_save_blocks + len(saves) > self.MAX_PENDING_SAVE_BLOCKS:
                logger.warning("KV saves back up (%d blocks pending): dropping %d",
                               self._pending_save_blocks, len(saves))
                self._dropped.extend(s.key for s in saves)
                return
            self._pending_save_blocks += len(saves)
        # a slot's page half of one block is one contiguous row, so the copy is a row
        # gather (a permute of the 6-d view was an element-wise strided copy, ~100x
        # slower on the CPU)
        self._submit(self._write, saves, self._gather([s.block_id for s in saves]).numpy())

    def _write(self, saves: list[BlockTransfer], host: np.ndarray) -> tuple[list, list]:
        saved, failed = [], []
        for i, s in enumerate(saves):
            data = self.stack.codec.encode(s.key, memoryview(host[i]))
            written = self.stack.put(s.key, data)
            # not written anywhere: either every tier already held it, or none was reachable
            if written or self.stack.contains(s.key):
                saved.append(s.key)
            else:
                failed.append(s.key)
        with self._lock:
            self._pending_save_blocks -= len(saves)
        return saved, failed

    # ---- reports ----------------------------------------------------------------------
    def _submit(self, fn, *args) -> None:
        if logger.isEnabledFor(logging.DEBUG):  # tracing: each job's wait and run time
            fn = self._traced(fn, time.perf_counter())
        future = self._pool.submit(fn, *args)
        with self._lock:
            self._in_flight.add(future)
        future.add_done_callback(self._finished)

    @staticmethod
    def _traced(fn, sent: float):
        """`fn`, logging at DEBUG how long it waited on the thread and how long it ran
        (`kv job <name> <request or blocks>: waited <ms> ran <ms>`)."""
        def run(*args):
            began = time.perf_counter()
            try:
                return fn(*args)
            finally:
                what = getattr(args[0], "request_id", None) if args else None
                logger.debug("kv job %s %s: waited %.1f ms ran %.1f ms", fn.__name__.lstrip("_"),
                             what if what is not None else len(args[0]) if args else "-",
                             (began - sent) * 1e3, (time.perf_counter() - began) * 1e3)
        return run

    def _finished(self, future: Future) -> None:
        self._done.put(future)  # queued before it stops counting as in flight (see drain)
        with self._lock:
            self._in_flight.discard(future)

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def report(self, wait_s: float = 0.0) -> WorkerReport:
        """What finished since the last report; waits up to `wait_s` for the first item
        when nothing has (an engine with only loading requests has nothing else to do)."""
        out = WorkerReport()
        with self._lock:
            out.failed_save_keys, self._dropped = self._dropped, []
        out.demoted_keys, self._demoted = self._demoted, []
        try:
            futures = [self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait()]
        except queue.Empty:
            futures = []
        self._collect(out, futures)
        if self.mirrored:
            # after the results: a finished save's changes are logged before it is done
            out.tier_changes = self.stack.take_changes()
            out.tier_stats = self.stack.snapshot()
        return out

    def _collect(self, out: WorkerReport, futures: list[Future]) -> None:
        """Add the results of `futures`, and of all others done by now, to `out`."""
        if not futures:
            return
        while True:
            try:
                futures.append(self._done.get_nowait())
            except queue.Empty:
                break
        for future in futures:
            result = future.result()  # a bug in a load or save surfaces here, loudly
            if result is None:  # a deferred move into the host
                continue
            if isinstance(result, LoadResult):
                out.loads.append(result)
            elif isinstance(result, int):
                out.num_prefetched += result
            else:
                out.saved_keys.extend(result[0])
                out.failed_save_keys.extend(result[1])

    def drain(self) -> WorkerReport:
        """Wait for everything in flight; its report."""
        while True:
            with self._lock:
                pending = list(self._in_flight)
            if not pending:
                return self.report()
            for f in pending:
                f.exception()
            time.sleep(0.0005)  # its done-callback runs just after waiters wake

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._staging_allocator is not None and self._staging_buffer is not None:
            self._staging_allocator.free(self._staging_buffer)
            self._staging_buffer = None
