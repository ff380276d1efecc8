"""The interface every KV tier implements, built-in or plugin (the `kv_tier` plugin kind:
`tokenmill_kv_tiers` returns factories `make(options, context) -> KVTier`).

A tier is a byte store of whole objects (objects.py) under 32-byte keys with a capacity
it enforces itself, evicting its least recently used objects to make room. It does not
interpret the bytes; the stack checks them on every read. Tiers are called from the
connector's worker thread and from the scheduler's lookups at once, so each guards its
own state. A tier whose backend is gone (a Redis server killed) raises
`TierUnavailableError` from any call; the stack then routes around it.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.platforms.interfaces import Allocator

ObjectKey = bytes  # 32 bytes: a layout fingerprint and a block hash, hashed together


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(value: int | str, name: str = "size") -> int:
    """Bytes from an int or a string like "8GiB", "100GB", "512MiB", "4096".

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB)
    powers of 1000. Raises ValueError naming `name` and the value.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a size")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        if m is None:
            raise ValueError(f"{name}={value!r} is not a size; write e.g. 8GiB, 100GB or 4096")
        base = 1024 if m.group(3) else 1000
        n = int(float(m.group(1)) * base ** _POWERS[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"{name}={value!r} must be at least one byte")
    return n


@dataclass(frozen=True, slots=True)
class TierContext:
    """What a tier factory may use besides its own options."""

    object_bytes: int  # the size of every object (one KV block of every arena slot, framed)
    layout_fingerprint: bytes  # 32 bytes naming the model and the byte layout
    host_allocator: Callable[[], Allocator]  # the platform's HOST_STAGING allocator


TierFactory = Callable[[Mapping[str, Any], TierContext], "KVTier"]


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
    # tokens it held that the cost model chose to recompute (faster than loading them)
    tokens_recompute_chosen: int = 0


class KVTier(ABC):
    """A store of KV objects. `name` is the entry point name it was created under;
    `num_evicted` counts the objects it dropped to make room.

    A tier that drops objects on its own (LRU eviction, a file gone behind its back) calls
    `_removed(key)` for each, so a stack that mirrors its contents in another process
    (the scheduler side over "mp" workers, directory.py) learns of it. A tier whose
    backend evicts out of its sight (Redis under maxmemory) cannot; a load of such a key
    then fails and only that suffix is recomputed."""

    name: str = "abstract"
    # whether other processes or hosts can write to it (a disk directory, Redis,
    # Mooncake): with a MAC key, objects read from it must carry a valid tag (objects.py)
    shared: bool = True
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

    def read_into(self, keys: list[ObjectKey], buffers: list[memoryview]) -> list[int | None]:
        """Read many objects at once, each into its buffer (a load's staging rows, one
        object's size each): per key, None if absent, else the stored object's size
        (the buffer holds it only when the size is the buffer's; a tier never writes
        past a buffer). Counts as a use. The default reads one `get` at a time; a tier
        overrides it to batch (one round trip) or to read into the buffer in place."""
        out: list[int | None] = []
        for key, buf in zip(keys, buffers, strict=True):
            data = self.get(key)
            if data is None:
                out.append(None)
                continue
            n = len(data)
            if n == len(buf):
                buf[:] = memoryview(data).cast("B")
            out.append(n)
        return out

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
