"""A multi-rank engine listens on loopback only: the torch.distributed store, gloo's pairs
and the ZMQ step sockets of two real worker processes (mp executor, tp=2). torch's own
`tcp://` rendezvous would listen on every interface."""

from __future__ import annotations

import ipaddress
import socket

import psutil
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.distributed.rendezvous import (
    interface_of,
    local_address_towards,
    parse_init_method,
)


def _listening(pid: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def test_workers_listen_on_loopback_only(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), dtype="float32", block_size=4, platform="cpu",
              num_kv_blocks=64, tensor_parallel_size=2)
    try:
        out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4  # the world formed and stepped
        addresses = {pid: _listening(pid) for pid in llm.engine.executor.pids}
    finally:
        llm.engine.shutdown()
    assert any(addresses.values()), addresses  # rank 0 serves the store at least
    for pid, ips in addresses.items():
        assert all(ipaddress.ip_address(ip).is_loopback for ip in ips), (pid, ips)


def test_the_interface_towards_a_host_holds_the_route_to_it():
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    name = interface_of("127.0.0.1")
    assert any(a.address == "127.0.0.1" for a in psutil.net_if_addrs()[name]
               if a.family == socket.AF_INET)
    with pytest.raises(ValueError, match="203.0.113.77"):
        interface_of("203.0.113.77")  # TEST-NET-3: held by no interface
    assert parse_init_method("tcp://127.0.0.1:2345") == ("127.0.0.1", 2345)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        parse_init_method("env://")
