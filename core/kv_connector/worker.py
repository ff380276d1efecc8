"""The connector's worker side: loads and saves KV pages between the arena and the tiers.

Per step, the runner calls `start_loads(meta.loads)` before its forward pass and
`save(meta.saves)` after it; `report()` then returns what finished. Loads run on the
worker's background thread, overlapped with the forward pass: the scheduler does not
compute on a loading request's blocks until the load has reported, so the thread and the
model never touch the same page. A save copies its pages out of the arena at once (the
block may be freed and reused by the next step) and leaves the framing, checksum and tier
writes to the background thread.

Ordering contract (the scheduler side relies on it): loads, saves and prefetches run on
that one thread in the order they were sent, so a load sent after the save of a block
reads what the save wrote, even while the save was still pending when the load was
planned.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from tokenmill.kv_connector.messages import BlockTransfer, LoadJob, LoadResult, WorkerReport
from tokenmill.kv_connector.objects import KVLayout, encode
from tokenmill.kv_connector.stack import TierStack
from tokenmill.platforms.interfaces import Allocator

logger = logging.getLogger(__name__)


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
        # one thread: jobs run in the order sent (the ordering contract above)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-connector")
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: set[Future] = set()
        self._lock = threading.Lock()
        self._staging_allocator = staging_allocator
        self._pending_save_blocks = 0
        self._dropped: list[bytes] = []  # saves refused for back-pressure, to report
        # the engine mirrors the stack from another process: reports carry its changes
        self.mirrored = False
        nbytes = layout.payload_bytes
        # a page of every layer, for loads: from the platform's host-staging allocator
        # (pinned memory on a device platform) so the copy into the arena runs at link speed
        self._staging = (
            staging_allocator.allocate(nbytes)
            if staging_allocator is not None
            else torch.empty(nbytes, dtype=torch.uint8)
        )

    def register_kv_caches(self, caches: list[torch.Tensor]) -> None:
        """Per-layer attention caches in the standard layout, [2, num_blocks, block_size,
        kv_heads, head_size] (one layer per arena slot)."""
        shapes = tuple((c.shape[0], *c.shape[2:]) for c in caches)
        if shapes != self.layout.layer_shapes:
            raise ValueError(f"KV caches of shapes {shapes} do not match the layout {self.layout}")
        self._rows = [c.view(torch.uint8).view(2, c.shape[1], -1) for c in caches]

    def register_page_rows(self, rows: list[torch.Tensor]) -> None:
        """The arena's slots as bytes, [H, num_blocks, page // H] each (`KVArena.page_rows`):
        a block's object is rows [:, block] of every slot, whatever the block holds
        (attention KV, MLA latents, recurrent state pages)."""
        shapes = tuple((r.shape[0], r.shape[2]) for r in rows)
        if shapes != self.layout.layer_shapes or self.layout.itemsize != 1:
            raise ValueError(f"KV page rows of shapes {shapes} do not match the layout {self.layout}")
        self._rows = rows

    # ---- loads ------------------------------------------------------------------------
    def start_loads(self, jobs: list[LoadJob]) -> None:
        for job in jobs:
            self._submit(self._load, job)

    def _load(self, job: LoadJob) -> LoadResult:
        tiers: list[str] = []
        for block in job.blocks:
            found = self.stack.get(block.key)
            if found is None:
                break
            payload, tier_name = found
            self._write_block(block.block_id, payload)
            tiers.append(tier_name)
        return LoadResult(job.request_id, len(tiers), len(job.blocks), tiers)

    def _write_block(self, block_id: int, payload: memoryview) -> None:
        self._staging.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        first = self._rows[0]
        pages = self._staging.view(len(self._rows), first.shape[0], first.shape[2])
        for slot, rows in enumerate(self._rows):
            rows[:, block_id].copy_(pages[slot])

    def start_prefetch(self, keys: list[bytes]) -> None:
        """Copy `keys` up into the fastest tier where only slower ones hold them."""
        if keys:
            self._submit(self._prefetch, keys)

    def _prefetch(self, keys: list[bytes]) -> int:
        fastest = self.stack.tiers[0]
        return sum(
            1 for k in keys if not fastest.contains(k) and self.stack.get(k) is not None
            and fastest.contains(k)
        )

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
        first = self._rows[0]
        ids = torch.tensor([s.block_id for s in saves], dtype=torch.int64).to(first.device)
        # [num_blocks, slots, H, page // H] bytes: a slot's page half of one block is one
        # contiguous row, so each copy is a row gather (a permute of the 6-d view was an
        # element-wise strided copy, ~100x slower on the CPU)
        out = torch.empty((len(saves), len(self._rows), first.shape[0], first.shape[2]),
                          dtype=torch.uint8, device=first.device)
        for slot, rows in enumerate(self._rows):
            for h in range(rows.shape[0]):
                out[:, slot, h] = rows[h].index_select(0, ids)
        host = out.cpu().reshape(len(saves), -1).numpy()
        self._submit(self._write, saves, host)

    def _write(self, saves: list[BlockTransfer], host: np.ndarray) -> tuple[list, list]:
        saved, failed = [], []
        for i, s in enumerate(saves):
            data = encode(s.key, memoryview(host[i]))
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
        future = self._pool.submit(fn, *args)
        with self._lock:
            self._in_flight.add(future)
        future.add_done_callback(self._finished)

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
        if self._staging_allocator is not None and self._staging is not None:
            self._staging_allocator.free(self._staging)
            self._staging = None
