"""KV transport over Mooncake's transfer engine (`mooncake.engine.TransferEngine`), the
engine under Mooncake's store (tier.py), used here point to point.

Each worker rank starts one transfer engine in P2P-handshake mode (no metadata server:
peers exchange segment descriptors on first contact over the engine's own RPC port) with
protocol `tcp` (`TOKENMILL_MOONCAKE_PROTOCOL` for `rdma` where there is a NIC), bound to
the context's host. `descriptor()` is "host:rpc_port", the name peers open its segment
by; a read is one `batch_transfer_async_read` over the regions, polled with
`get_batch_transfer_status` (0: done, negative: failed, e.g. the peer is gone).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pluggy

from tokenmill.platforms.kv_transport import (
    KVTransport,
    Region,
    TransportContext,
    TransportError,
)

logger = logging.getLogger(__name__)

hookimpl = pluggy.HookimplMarker("tokenmill")

_DONE = 0
_RUNNING = (1, 2)  # WAITING, PENDING in the engine's status enum


class MooncakeTransport(KVTransport):
    name = "mooncake"

    def __init__(self, context: TransportContext) -> None:
        super().__init__()
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransportError(
                "the mooncake KV transport needs Mooncake's transfer engine: pip install "
                f"mooncake-transfer-engine-non-cuda (and Debian's libibverbs1 librdmacm1): {exc}"
            ) from exc
        protocol = os.environ.get("TOKENMILL_MOONCAKE_PROTOCOL", "tcp")
        self._engine = TransferEngine()
        rc = self._engine.initialize(context.host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise TransportError(f"mooncake: the transfer engine failed to start on "
                                 f"{context.host} over {protocol} (code {rc})")
        self._address = f"{context.host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._handles: dict[int, int] = {}  # batch id -> bytes

    def register(self, address: int, length: int) -> None:
        rc = self._engine.register_memory(address, length)
        if rc != 0:
            raise TransportError(f"mooncake: registering {length} bytes failed (code {rc})")
        self._registered.append(address)

    def descriptor(self) -> bytes:
        return self._address.encode()

    def connect(self, descriptor: bytes) -> str:
        return descriptor.decode()  # P2P handshake: the first transfer opens the segment

    def start_read(self, peer: str, regions: list[Region]) -> object:
        if not regions:
            return None
        local, remote, lengths = (list(c) for c in zip(*regions, strict=True))
        batch = self._engine.batch_transfer_async_read(peer, local, remote, lengths)
        if batch == 0 or batch < 0:
            self.stats.failed_reads += 1
            raise TransportError(f"mooncake: cannot read from peer {peer!r} (code {batch})")
        self._handles[batch] = sum(lengths)
        return batch

    def poll(self, handle: object) -> bool:
        if handle is None:
            return True
        if handle not in self._handles:
            raise TransportError("mooncake: unknown or finished transfer handle")
        status = self._engine.get_batch_transfer_status([handle])
        if status in _RUNNING:
            return False
        nbytes = self._handles.pop(handle)
        if status != _DONE:
            self.stats.failed_reads += 1
            raise TransportError(f"mooncake: a read failed (status {status})")
        self.stats.reads += 1
        self.stats.bytes_read += nbytes
        return True

    def cancel(self, handle: object) -> None:
        if self._handles.pop(handle, None) is not None:
            self.stats.failed_reads += 1

    def close(self) -> None:
        for address in self._registered:
            self._engine.unregister_memory(address)
        self._registered.clear()


@hookimpl
def tokenmill_api_version() -> str:
    return "1.6"  # the kv_transport plugin kind


@hookimpl
def tokenmill_kv_transports() -> dict[str, Any]:
    return {"mooncake": MooncakeTransport}
