"""Remote tier: a Redis or Valkey server, through redis-py.

Objects are string values under `tokenmill:kv:<key hex>`, written with SET NX so two
engines saving the same prefix store it once. Capacity and eviction are the server's
(`maxmemory` with an LRU policy); we keep none of our own. When the server cannot be
reached, every call raises `TierUnavailableError` at once for `retry_after_s` seconds
instead of waiting out a timeout per block, then tries again: a killed server costs one
timeout, and a restarted one comes back on its own.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from tokenmill.kv_connector.objects import ObjectKey
from tokenmill.platforms.kv_tier import KVTier, TierUnavailableError

logger = logging.getLogger(__name__)

_PREFIX = b"tokenmill:kv:"


class RedisTier(KVTier):
    name = "redis"

    def __init__(
        self, url: str, *, socket_timeout_s: float = 2.0, retry_after_s: float = 5.0
    ) -> None:
        self.url = url
        self._client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )
        self._retry_after_s = retry_after_s
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.num_evicted = 0  # objects dropped to make room

    @property
    def capacity_bytes(self) -> None:
        return None

    def _call(self, what: str, fn):
        if time.monotonic() < self._down_until:
            raise TierUnavailableError(f"redis tier {self.url} is down (retrying later)")
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            with self._lock:
                if time.monotonic() >= self._down_until:
                    logger.warning(
                        "redis tier %s unavailable during %s (%s); the other tiers carry on, "
                        "retrying in %.0f s", self.url, what, exc, self._retry_after_s,
                    )
                self._down_until = time.monotonic() + self._retry_after_s
            raise TierUnavailableError(f"redis tier {self.url}: {exc}") from exc
        except redis.RedisError as exc:  # e.g. OOM under maxmemory: this call fails, not the tier
            logger.warning("redis tier %s: %s failed: %s", self.url, what, exc)
            raise TierUnavailableError(f"redis tier {self.url}: {what}: {exc}") from exc

    @staticmethod
    def redis_key(key: ObjectKey) -> bytes:
        return _PREFIX + key.hex().encode()

    def used_bytes(self) -> int:
        return int(self._call("info", lambda: self._client.info("memory"))["used_memory"])

    def contains(self, key: ObjectKey) -> bool:
        return bool(self._call("exists", lambda: self._client.exists(self.redis_key(key))))

    def contains_many(self, keys: list[ObjectKey]) -> list[bool]:
        if not keys:
            return []

        def run():
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.redis_key(k))
            return pipe.execute()

        return [bool(n) for n in self._call("exists", run)]

    def get(self, key: ObjectKey) -> bytes | None:
        data = self._call("get", lambda: self._client.get(self.redis_key(key)))
        if data is None:
            return None
        return data

    def read_into(self, keys: list[ObjectKey], buffers: list[memoryview]) -> list[int | None]:
        """One MGET for all keys (one round trip), copied into the buffers."""
        if not keys:
            return []
        values = self._call("mget", lambda: self._client.mget([self.redis_key(k) for k in keys]))
        out: list[int | None] = []
        for data, buf in zip(values, buffers, strict=True):
            if data is None:
                out.append(None)
                continue
            if len(data) == len(buf):
                buf[:] = data
            out.append(len(data))
        return out

    def put(self, key: ObjectKey, data: bytes | memoryview) -> bool:
        rkey = self.redis_key(key)
        if self._call("exists", lambda: self._client.exists(rkey)):
            return False  # don't ship the bytes for nothing
        written = self._call("set", lambda: self._client.set(rkey, bytes(data), nx=True))
        return bool(written)

    def delete(self, key: ObjectKey) -> None:
        self._call("delete", lambda: self._client.delete(self.redis_key(key)))

    def keys(self) -> list[ObjectKey]:
        found = self._call(
            "scan", lambda: list(self._client.scan_iter(match=_PREFIX + b"*", count=1000))
        )
        return [bytes.fromhex(k[len(_PREFIX):].decode()) for k in found]

    def close(self) -> None:
        self._client.close()
