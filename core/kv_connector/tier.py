"""The interface every KV tier implements, built-in or plugin.

A tier is a byte store of whole objects (objects.py) under 32-byte keys with a capacity
it enforces itself, evicting its least recently used objects to make room. It does not
interpret the bytes; the stack checks them on every read. Tiers are called from the
connector's worker thread and from the scheduler's lookups at once, so each guards its
own state. A tier whose backend is gone (a Redis server killed) raises
`TierUnavailableError` from any call; the stack then routes around it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.kv_connector.objects import ObjectKey


class TierUnavailableError(RuntimeError):
    """The tier's backend cannot be reached now (says which and why)."""


@dataclass(slots=True)
class TierStats:
    """Counters of one tier in a stack, monotonic, kept by the stack. `bytes_written`
    counts saves the tier did not already hold, so it equals the unique content saved to
    it; copies up from a lower tier on a hit count as `bytes_promoted`."""

    hits: int = 0  # objects found by get
    misses: int = 0  # gets of absent objects
    bytes_written: int = 0
    bytes_promoted: int = 0
    bytes_read: int = 0
    corrupt: int = 0  # objects that failed their checks on read (then deleted)
    errors: int = 0  # calls that failed because the backend was unavailable
    tokens_loaded: int = 0  # tokens of KV loaded into the device from this tier
    tokens_recomputed: int = 0  # tokens this tier was expected to supply but did not


class KVTier(ABC):
    """A store of KV objects. `name` is the entry point name it was created under;
    `num_evicted` counts the objects it dropped to make room.

    A tier that drops objects on its own (LRU eviction, a file gone behind its back) calls
    `_removed(key)` for each, so a stack that mirrors its contents in another process
    (the scheduler side over "mp" workers, directory.py) learns of it. A tier whose
    backend evicts out of its sight (Redis under maxmemory) cannot; a load of such a key
    then fails and only that suffix is recomputed."""

    name: str = "abstract"
    removal_listener: Callable[[ObjectKey], None] | None = None  # set by the stack

    def _removed(self, key: ObjectKey) -> None:
        """Tell the stack `key` is no longer held here (called under the tier's lock)."""
        listener = self.removal_listener
        if listener is not None:
            listener(key)

    @property
    @abstractmethod
    def capacity_bytes(self) -> int | None:
        """The most bytes it holds (None: bounded by the backend, not by us)."""

    @abstractmethod
    def used_bytes(self) -> int: ...

    @abstractmethod
    def contains(self, key: ObjectKey) -> bool:
        """Whether `key` is held now. Does not count as a use for eviction."""

    def contains_many(self, keys: list[ObjectKey]) -> list[bool]:
        """`contains` of each key (a remote tier answers in one round trip)."""
        return [self.contains(k) for k in keys]

    @abstractmethod
    def get(self, key: ObjectKey) -> bytes | memoryview | None:
        """The stored object (header and payload), or None if absent. Counts as a use."""

    @abstractmethod
    def put(self, key: ObjectKey, data: bytes | memoryview) -> bool:
        """Store `data` under `key`, evicting LRU objects if needed. Returns False, writing
        nothing, when the key is already held or the object can never fit."""

    @abstractmethod
    def delete(self, key: ObjectKey) -> None:
        """Drop `key` if held (a corrupt object, or an explicit eviction)."""

    @abstractmethod
    def keys(self) -> list[ObjectKey]:
        """Every key held, least recently used first where the tier knows the order."""

    def close(self) -> None:  # noqa: B027 - optional: tiers with resources override
        """Release the tier's resources (connections, buffers). Idempotent."""
