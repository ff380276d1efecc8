"""The interface every KV transport implements: how prefill/decode disaggregation moves
KV pages from one engine's arena into another's (docs/disaggregation.md).

A transport is one-sided: the engine that holds the pages (the prefill side) registers
its KV arena and publishes `descriptor()`; the engine that wants them (the decode side)
connects with that descriptor and reads byte ranges of the peer's registered memory into
its own registered memory, without the peer's engine taking part (its transport's own
threads serve the read). The core decides which bytes: a transport never interprets
them, it only moves (local address, remote address, length) regions and counts them.

Transports are plugins (entry point group `tokenmill.kv_transports`, hook
`tokenmill_kv_transports`): each is a factory `make(context) -> KVTransport`. Built on
libraries made for the job (NIXL over UCX, Mooncake's transfer engine), never pickle and
never a server of our own. A read of a peer that is gone fails (`TransportError`, or a
handle that `poll` reports failed) within the transport's own timeouts; the core also
bounds every pull by its own deadline and then recomputes instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


class TransportError(RuntimeError):
    """A transfer or a connection failed (says which peer and why)."""


@dataclass(frozen=True, slots=True)
class TransportContext:
    """What a transport is built with, once per worker rank."""

    name: str  # unique among the engines that talk (engine id and rank): the agent's name
    host: str = "127.0.0.1"  # the address its listeners bind and peers reach it at
    # the rank's device ("cpu", "cuda:0", ...): registered memory lives there; a transport
    # that moves device memory device to device reads it
    device: str = "cpu"


@dataclass(slots=True)
class TransportStats:
    """Counters of one transport, monotonic."""

    bytes_read: int = 0  # bytes of completed reads into this engine's memory
    reads: int = 0  # completed reads (each a list of regions)
    failed_reads: int = 0


# (local address, remote address, length in bytes): one contiguous region to read
Region = tuple[int, int, int]


class KVTransport(ABC):
    """Moves byte regions from a peer's registered memory into this process's.

    Call order: `register` the local memory (the KV arena) once, publish `descriptor()`;
    peers `connect(descriptor)` and `start_read` regions of it into their own registered
    memory, then `poll` the handle until it is done. `stats` counts what arrived.
    Methods are called from one thread (the worker's).
    """

    name: str = "abstract"

    def __init__(self) -> None:
        self.stats = TransportStats()

    @abstractmethod
    def register(self, address: int, length: int) -> None:
        """Expose `length` bytes at `address` (this process's memory) to peers' reads and
        as the destination of this process's reads."""

    @abstractmethod
    def descriptor(self) -> bytes:
        """What a peer needs to reach this transport and its registered memory (opaque
        bytes; crosses to peers as plain data, never pickled)."""

    @abstractmethod
    def connect(self, descriptor: bytes) -> str:
        """Make a peer reachable from its `descriptor()`; returns the peer's id for
        `start_read`. Connecting twice to the same peer returns the same id."""

    @abstractmethod
    def start_read(self, peer: str, regions: list[Region]) -> object:
        """Start reading `regions` from `peer` into local memory; returns a handle at once
        (the transfer runs in the background). Raises `TransportError` naming the peer
        when it cannot start."""

    @abstractmethod
    def poll(self, handle: object) -> bool:
        """True once the read of `handle` has completed (its bytes are in place; counted
        in `stats`), False while it runs. Raises `TransportError` when it failed."""

    @abstractmethod
    def cancel(self, handle: object) -> None:
        """Give up on a read (its deadline passed, or another rank's failed): release what
        it holds. The bytes of its destination are then undefined."""

    @abstractmethod
    def close(self) -> None:
        """Release every connection and registration (the process may exit after)."""
