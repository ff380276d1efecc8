"""Remote tier: Mooncake's distributed store (`mooncake.store.MooncakeDistributedStore`).

URL: `mooncake://MASTER_HOST:RPC_PORT?metadata=URL&segment=SIZE&buffer=SIZE&protocol=tcp
&local=HOST`. The master (`mooncake_master`) keeps the index; each client mounts a
segment of its own memory (`segment`, default 256MiB) into the store's global pool and
moves bytes over the transfer engine (`protocol`: tcp here, rdma where there is a NIC).
`metadata` is the transfer engine's metadata service (the master's own with
`-enable_http_metadata_server`; default `http://MASTER_HOST:8080/metadata`).

Objects go under `tokenmill:kv:<key hex>`. A put of a key the store holds is skipped
(`is_exist` first; the store also keeps the first value of a key). Capacity and eviction
are the master's, out of our sight (like Redis under maxmemory), so `keys()` lists only
what this client stored and has not seen go; a stale one fails its load and that suffix is
recomputed.

Failures. The client keeps a pool of connections to the master (one per thread that has
called at once: ours and its own heartbeat thread). A connection that dropped while idle
fails the next call made on it with RPC_FAIL (-900) at once, and the pool replaces it;
with several pooled connections, several calls in a row fail so. Such a call is tried
again, up to `rpc_attempts` times in all: a turn no longer loses the tier for
`retry_after_s` (and recomputes what it holds) because of one dropped link. A get, whose
b"" says nothing, asks get_size why. A put is three calls (PutStart, the transfer,
PutEnd): one whose PutEnd was lost leaves the key reserved, unreadable, for the master's
put_start_discard_timeout_sec, and a second put of it reports success without storing;
so a put is tried again as an upsert, which replaces the reservation, and checked.
RPC_FAIL on every attempt, or after the pool's own reconnects (over a second: the master
gone), marks the tier down: it is skipped for `retry_after_s`, then tried again. Any
other error code fails only that call (`TierUnavailableError`, logged): the store full
(-200, every object under a lease or pinned), an object over the client's buffer (-600).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pluggy

from tokenmill.platforms.kv_tier import (
    KVTier,
    ObjectKey,
    TierContext,
    TierFactory,
    TierUnavailableError,
    parse_size,
)

hookimpl = pluggy.HookimplMarker("tokenmill")
logger = logging.getLogger(__name__)

_PREFIX = "tokenmill:kv:"
_OBJECT_NOT_FOUND = -704  # mooncake's ErrorCode::OBJECT_NOT_FOUND
_OBJECT_EXISTS = -705  # ErrorCode::OBJECT_ALREADY_EXISTS: another writer stored it first
_RPC_FAIL = -900  # ErrorCode::RPC_FAIL: the call did not reach the master, or no answer
# A dropped pooled connection fails at once; a call that failed only after this long went
# through the pool's own connect retries (seconds), so the master is unreachable
_SLOW_FAILURE_S = 1.0


class MooncakeTier(KVTier):
    name = "mooncake"

    def __init__(
        self, url: str, *, segment_bytes: int, buffer_bytes: int, metadata: str,
        protocol: str = "tcp", local_host: str = "127.0.0.1", retry_after_s: float = 5.0,
        rpc_attempts: int = 4,
    ) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ValueError(
                f"kv_offload_remote={url!r} needs Mooncake's store: pip install "
                f"mooncake-transfer-engine-non-cuda (it loads libibverbs: Debian's "
                f"libibverbs1 librdmacm1): {exc}"
            ) from exc
        parts = urlsplit(url)
        if not parts.hostname or not parts.port:
            raise ValueError(f"kv_offload_remote={url!r}: write mooncake://MASTER_HOST:RPC_PORT")
        self.url = url
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_host, metadata, segment_bytes, buffer_bytes, protocol, "",
                               f"{parts.hostname}:{parts.port}")
        if rc != 0:
            raise ValueError(f"kv_offload_remote={url!r}: Mooncake setup failed with code {rc} "
                             f"(is mooncake_master running there, metadata at {metadata}?)")
        self._retry_after_s = retry_after_s
        self._rpc_attempts = rpc_attempts
        self._down_until = 0.0
        self.num_rpc_retries = 0  # calls tried again after a dropped connection
        self._lock = threading.Lock()
        self._sizes: dict[ObjectKey, int] = {}  # what this client stored (insertion order)
        self.num_evicted = 0

    @staticmethod
    def store_key(key: ObjectKey) -> str:
        return _PREFIX + key.hex()

    def _call(self, what: str, fn: Callable[[], Any], codes: Callable[[Any], list[int]]):
        """`fn()` (one store call), tried again while it fails with RPC_FAIL, up to
        `rpc_attempts` times; `codes(result)`: its error codes. Raises
        TierUnavailableError on any error code left."""
        self._up()
        for attempt in range(1, self._rpc_attempts + 1):
            start = time.monotonic()
            result = fn()
            failed = [rc for rc in codes(result) if rc < 0 and rc != _OBJECT_NOT_FOUND]
            if not failed or _RPC_FAIL not in failed or attempt == self._rpc_attempts:
                break
            if time.monotonic() - start > _SLOW_FAILURE_S:
                break  # the pool's own reconnects ran and failed: the master is gone
            self.num_rpc_retries += 1
            logger.warning("mooncake tier %s: %s failed with RPC_FAIL (attempt %d of %d: a "
                           "dropped connection to the master?); trying again",
                           self.url, what, attempt, self._rpc_attempts)
        if not failed:
            return result
        if _RPC_FAIL in failed:
            with self._lock:
                self._down_until = time.monotonic() + self._retry_after_s
            logger.warning("mooncake tier %s: %s failed with RPC_FAIL %d times; the master "
                           "does not answer: skipped for %.0f s", self.url, what,
                           self._rpc_attempts, self._retry_after_s)
        else:
            logger.warning("mooncake tier %s: %s failed with code %d", self.url, what, failed[0])
        raise TierUnavailableError(f"mooncake tier {self.url}: {what}: code {failed[0]}")

    def _up(self) -> None:
        if time.monotonic() < self._down_until:
            raise TierUnavailableError(f"mooncake tier {self.url} is down (retrying later)")

    @property
    def capacity_bytes(self) -> None:
        return None  # the store's global pool, the master's to manage

    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def contains(self, key: ObjectKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[ObjectKey]) -> list[bool]:
        if not keys:
            return []
        names = [self.store_key(k) for k in keys]
        found = self._call("exist", lambda: self._store.batch_is_exist(names), list)
        return [rc == 1 for rc in found]

    def get(self, key: ObjectKey) -> bytes | None:
        name = self.store_key(key)

        def fetch() -> tuple[bytes, int]:
            # The store's get reports no error code: b"" is both "not held" and "the call
            # met a dropped connection". get_size tells them apart: -704 not held, -900
            # the link; a size means the get's own link dropped (tried again, as RPC_FAIL).
            data = self._store.get(name)
            return (data, 0) if data else (b"", self._store.get_size(name))

        data, _ = self._call("get", fetch,
                             lambda r: [] if r[0] else [r[1] if r[1] < 0 else _RPC_FAIL])
        if not data:  # not held
            with self._lock:
                self._sizes.pop(key, None)
            return None
        return data

    def put(self, key: ObjectKey, data: bytes | memoryview) -> bool:
        if self.contains(key):
            return False
        name, value = self.store_key(key), bytes(data)
        attempts = 0

        def attempt() -> int:
            nonlocal attempts
            attempts += 1
            if attempts == 1:
                return self._store.put(name, value)
            # A put is PutStart, the transfer, PutEnd: an attempt whose PutEnd met a
            # dropped link leaves the key reserved and never readable (until the master
            # discards it: put_start_discard_timeout_sec, 30 s by default), and a put of
            # a reserved key reports success without storing. An upsert replaces it.
            return self._store.upsert(name, value)

        rc = self._call("put", attempt, lambda rc: [] if rc == _OBJECT_EXISTS else [rc])
        if rc == _OBJECT_EXISTS and attempts == 1:
            return False  # another client stored it first
        if attempts > 1 and not self.contains(key):
            # the last attempt's own end was lost as well: not held, so not recorded
            # (a lookup that counted on it would find nothing and recompute)
            logger.warning("mooncake tier %s: put of %s not readable after %d attempts",
                           self.url, key.hex()[:16], attempts)
            return False
        # stored (after a retry: by an upsert, or by an earlier attempt that reported
        # RPC_FAIL and had landed): ours, so the stack records it held
        with self._lock:
            self._sizes[key] = len(data)
        return True

    def delete(self, key: ObjectKey) -> None:
        self._up()
        rc = self._store.remove(self.store_key(key))
        with self._lock:
            self._sizes.pop(key, None)
        if rc < 0 and rc != _OBJECT_NOT_FOUND:
            # e.g. a lease not yet expired: the object stays until the master drops it;
            # reads check every object, so a corrupt one left there is never returned
            logger.info("mooncake tier %s: remove of %s: code %d", self.url, key.hex()[:16], rc)
        self._removed(key)

    def keys(self) -> list[ObjectKey]:
        with self._lock:
            return list(self._sizes)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


@hookimpl
def tokenmill_api_version() -> str:
    return "1.6"  # the kv_tier plugin kind


@hookimpl
def tokenmill_kv_tiers() -> dict[str, TierFactory]:
    return {"mooncake": make_mooncake_tier}


def make_mooncake_tier(options: Mapping[str, Any], context: TierContext) -> KVTier:
    """The `mooncake` tier: options {"url": "mooncake://HOST:PORT?..."}."""
    if "url" not in options:
        raise ValueError("the mooncake tier needs a URL: kv_offload_remote='mooncake://HOST:PORT'")
    url = str(options["url"])
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"metadata", "segment", "buffer", "protocol", "local"}
    if unknown:
        raise ValueError(f"kv_offload_remote={url!r}: unknown options {sorted(unknown)}")
    object_bytes = context.object_bytes
    segment = parse_size(query.get("segment", "256MiB"), "mooncake segment")
    buffer = parse_size(query.get("buffer", str(max(16 << 20, 4 * object_bytes))), "mooncake buffer")
    return MooncakeTier(
        url, segment_bytes=segment, buffer_bytes=buffer,
        metadata=query.get("metadata", f"http://{parts.hostname}:8080/metadata"),
        protocol=query.get("protocol", "tcp"), local_host=query.get("local", "127.0.0.1"),
    )
