"""Where the host tier fits: the scheduler side's view of it as the device pool's victim
cache (pure Python).

- Evictions. The device pool tells the connector of every cached block an allocation is
  about to reuse (`BlockPool.evict_listener`); each becomes an `EvictedBlock` of the next
  step, which the worker copies into the host before the forward pass overwrites it.
  Until the worker reports it, the block counts as held by the host (a lookup in the
  same step loads it from there: the worker moves it in before it starts that load).
- Prefetches. A request that waits for admission while some of its blocks lie only in a
  durable tier (disk, remote) gets them copied into the host in the background, pinned
  there for it (never evicted to make room for others) until it is admitted and its
  load ends, or it finishes. Pins take at most half the host, so evictions always find
  room.
"""

from __future__ import annotations

from tokenmill.kv.block_pool import KVBlock
from tokenmill.kv_connector.objects import ObjectKey, object_key
from tokenmill.platforms.kv_messages import (
    ConnectorStepMeta,
    EvictedBlock,
    PrefetchJob,
    WorkerReport,
)


class HostPlacement:
    """`host`: the host tier's name (None: the stack has none, and this does nothing);
    `host_objects`: how many objects it holds."""

    def __init__(self, fingerprint: bytes, host: str | None, host_objects: int) -> None:
        self.fingerprint = fingerprint
        self.host = host
        self.max_pinned = host_objects // 2
        self.num_pinned = 0
        self._demotes: list[EvictedBlock] = []
        self._demoting: set[ObjectKey] = set()
        self._prefetch: list[PrefetchJob] = []
        self._prefetched: dict[str, int] = {}  # request id -> objects pinned for it
        self._seen: set[str] = set()  # requests looked at for a prefetch (once each)
        self._unpin: list[str] = []

    def evicted(self, block: KVBlock) -> None:
        """`BlockPool.evict_listener`: move the block's content to the host."""
        if self.host is None or block.block_hash is None:
            return
        key = object_key(self.fingerprint, block.block_hash)
        self._demotes.append(EvictedBlock(block.block_id, key, block.benefit))
        self._demoting.add(key)

    def arriving(self, key: ObjectKey) -> bool:
        """Whether `key` is on its way into the host (evicted, not yet reported)."""
        return key in self._demoting

    def prefetch(self, request_id: str, keys: list[ObjectKey]) -> bool:
        """Queue the copy of `keys` into the host for a waiting request, once per request;
        past the pin budget only its first keys (the head of its prefix). Whether any
        was queued."""
        if self.host is None or request_id in self._seen:
            return False
        self._seen.add(request_id)
        keys = keys[: max(0, self.max_pinned - self.num_pinned)]  # its first blocks first
        if keys:
            self._prefetch.append(PrefetchJob(request_id, keys))
        self._prefetched[request_id] = len(keys)
        self.num_pinned += len(keys)
        return bool(keys)

    def prefetched(self, request_id: str) -> bool:
        """Whether the request was looked at for a prefetch already."""
        return request_id in self._seen

    def forget(self, request_id: str) -> None:
        """The request finished: release its pins and forget it."""
        self.release(request_id)
        self._seen.discard(request_id)

    def release(self, request_id: str) -> None:
        """The request no longer needs its prefetched objects pinned."""
        n = self._prefetched.pop(request_id, None)
        if n is not None:
            self.num_pinned -= n
            self._unpin.append(request_id)

    @property
    def has_unsent(self) -> bool:
        return bool(self._demotes or self._prefetch or self._unpin)

    def fill(self, meta: ConnectorStepMeta) -> None:
        """Put what waits to be sent into the step's connector part."""
        meta.demotes, self._demotes = self._demotes, []
        meta.prefetch, self._prefetch = self._prefetch, []
        meta.unpin, self._unpin = self._unpin, []

    def reported(self, report: WorkerReport) -> None:
        for key in report.demoted_keys:
            self._demoting.discard(key)
