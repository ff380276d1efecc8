"""The torch.distributed rendezvous of a multi-rank engine, bound to one address.

torch's `tcp://` rendezvous listens on every interface (its TCPStore binds the wildcard
address whatever host the URL names), and gloo's transport on whatever the machine's
hostname resolves to. Here rank 0 listens on the rendezvous host only, and gloo binds the
interface that carries this rank's route to that host: loopback when every rank is on
this machine (the mp executor's `tcp://127.0.0.1:PORT`), the cluster's network for Ray
over several hosts (the node address Ray reports).
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from urllib.parse import urlsplit

import psutil
import torch.distributed as dist

logger = logging.getLogger(__name__)

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"  # gloo's own switch; a value set by the user wins


def free_loopback_init_method() -> str:
    """A rendezvous on a free loopback port, for ranks that all run on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def parse_init_method(init_method: str) -> tuple[str, int]:
    """(host, port) of a `tcp://HOST:PORT` rendezvous."""
    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or not parts.hostname or not parts.port:
        raise ValueError(f"dist_init_method={init_method!r}: write tcp://HOST:PORT")
    return parts.hostname, parts.port


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (itself when `host` is local). A
    connected UDP socket sends nothing; the kernel only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def interface_of(address: str) -> str:
    """The name of the network interface that holds `address`."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    raise ValueError(f"no network interface holds {address}; set {GLOO_INTERFACE_ENV}")


def rendezvous_store(host: str, port: int, rank: int, world_size: int,
                     timeout: timedelta) -> dist.TCPStore:
    """The world's key-value store: served by rank 0 on `host`:`port` alone (never the
    wildcard address), joined there by the other ranks."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    listener = socket.create_server((host, port), backlog=max(128, 2 * world_size))
    # the store takes the listening socket over and closes it when it stops
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                         master_listen_fd=listener.detach())


def join_world(init_method: str, backend: str, rank: int, world_size: int) -> None:
    """`torch.distributed.init_process_group` over `init_method` (tcp://HOST:PORT), every
    socket of it bound to HOST or to this rank's interface towards it."""
    host, port = parse_init_method(init_method)
    if backend == "gloo" and not os.environ.get(GLOO_INTERFACE_ENV):
        # read by gloo when a process group is created (this world and every new_group)
        os.environ[GLOO_INTERFACE_ENV] = interface_of(local_address_towards(host))
    timeout = dist.constants.default_pg_timeout
    store = rendezvous_store(host, port, rank, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    logger.debug("rank %d: joined the world at %s (gloo on %s)", rank, init_method,
                 os.environ.get(GLOO_INTERFACE_ENV))
