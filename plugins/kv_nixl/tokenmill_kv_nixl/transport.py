"""KV transport over NIXL (NVIDIA's inference transfer library) with its UCX backend.

Each worker rank holds one NIXL agent named after the engine and rank. `register` puts
the KV arena in the agent's registry; `descriptor()` is the agent's metadata (NIXL's own
serialized bytes: its UCX worker address and the registered regions' remote keys), which
the peer loads with `add_remote_agent`. A read is one NIXL READ request over the regions,
posted at once and polled: UCX moves the bytes on the agent's progress thread, in the
background of the engine's step.

UCX's transports: TCP unless `UCX_TLS` says otherwise, on the loopback device when the
context's host is a loopback address (`UCX_NET_DEVICES=lo` unless set), so nothing leaves
the machine in tests; on a GPU machine set `UCX_TLS` for the NIC and CUDA transports and
registered device memory moves device to device. Both are read once, when the first
agent of the process starts.

Install: `pip install nixl-cu12` (the `nixl` meta package pulls both CUDA variants and a
newer torch; nixl-cu12 runs on the torch already installed, and its UCX backend moves
host memory on machines without CUDA).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

import numpy as np
import pluggy

from tokenmill.platforms.kv_transport import (
    KVTransport,
    Region,
    TransportContext,
    TransportError,
)

logger = logging.getLogger(__name__)

hookimpl = pluggy.HookimplMarker("tokenmill")

_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def _nixl_api() -> Any:
    """NIXL's Python API module, from whichever of its wheels is installed."""
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise TransportError(
        "the nixl KV transport needs NIXL: pip install nixl-cu12 (" + "; ".join(errors) + ")"
    )


def _ucx_environment(host: str) -> None:
    """UCX over TCP, on loopback for a loopback host, unless the user chose otherwise
    (read by UCX when the process's first agent starts)."""
    os.environ.setdefault("UCX_TLS", "tcp")
    if host.startswith("127.") or host in ("localhost", "::1"):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


class NixlTransport(KVTransport):
    name = "nixl"

    def __init__(self, context: TransportContext) -> None:
        super().__init__()
        _ucx_environment(context.host)
        api = _nixl_api()
        self._agent = api.nixl_agent(context.name, api.nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise TransportError(f"NIXL agent {context.name!r} has no UCX backend (plugins: "
                                 f"{self._agent.plugin_list})")
        self._mem = "DRAM" if context.device.startswith("cpu") else "VRAM"
        self._device_id = int(context.device.split(":")[1]) if ":" in context.device else 0
        self._registered: list = []
        self._peers: dict[bytes, str] = {}
        self._handles: dict[int, tuple[Any, int]] = {}  # id(handle) -> (handle, bytes)
        self._closed = False

    def register(self, address: int, length: int) -> None:
        descs = self._agent.register_memory(
            [(address, length, self._device_id, "")], self._mem)
        self._registered.append(descs)

    def descriptor(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def connect(self, descriptor: bytes) -> str:
        peer = self._peers.get(descriptor)
        if peer is None:
            name = self._agent.add_remote_agent(descriptor)
            peer = name.decode() if isinstance(name, bytes) else str(name)
            self._peers[descriptor] = peer
        return peer

    def start_read(self, peer: str, regions: list[Region]) -> object:
        if not regions:
            return _Done()
        table = np.asarray(regions, dtype=np.uint64)
        local = np.stack(
            [table[:, 0], table[:, 2], np.full(len(table), self._device_id, np.uint64)], 1)
        remote = np.stack(
            [table[:, 1], table[:, 2], np.full(len(table), self._device_id, np.uint64)], 1)
        try:
            handle = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(local, self._mem),
                self._agent.get_xfer_descs(remote, self._mem), peer)
            state = self._agent.transfer(handle)
        except Exception as exc:  # NIXL raises its own exception types per failure
            raise TransportError(f"nixl: cannot read from peer {peer!r}: {exc}") from exc
        if state == "ERR":
            self._release(handle)
            raise TransportError(f"nixl: the read from peer {peer!r} failed to start")
        self._handles[id(handle)] = (handle, int(table[:, 2].sum()))
        return handle

    def poll(self, handle: object) -> bool:
        if isinstance(handle, _Done):
            return True
        entry = self._handles.get(id(handle))
        if entry is None:
            raise TransportError("nixl: unknown or finished transfer handle")
        state = self._agent.check_xfer_state(handle)
        if state == "PROC":
            return False
        del self._handles[id(handle)]
        self._release(handle)
        if state != "DONE":
            self.stats.failed_reads += 1
            raise TransportError(f"nixl: a read failed (state {state})")
        self.stats.reads += 1
        self.stats.bytes_read += entry[1]
        return True

    def cancel(self, handle: object) -> None:
        entry = self._handles.pop(id(handle), None)
        if entry is not None:
            self.stats.failed_reads += 1
            self._release(handle)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - a transfer UCX cannot cancel stays with the agent
            logger.warning("nixl: could not release a transfer handle", exc_info=True)

    def close(self) -> None:
        """Release handles, peers and registrations, then the agent (in that order: an
        agent torn down with live handles crashes the process at exit)."""
        if self._closed:
            return
        self._closed = True
        for handle, _ in list(self._handles.values()):
            self._release(handle)
        self._handles.clear()
        for peer in self._peers.values():
            self._agent.remove_remote_agent(peer)
        self._peers.clear()
        for descs in self._registered:
            self._agent.deregister_memory(descs)
        self._registered.clear()
        del self._agent


class _Done:
    """The handle of an empty read."""


@hookimpl
def tokenmill_api_version() -> str:
    return "1.6"  # the kv_transport plugin kind


@hookimpl
def tokenmill_kv_transports() -> dict[str, Any]:
    return {"nixl": NixlTransport}
