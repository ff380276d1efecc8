"""A loopback TCP proxy, in a process of its own, whose open connections a test can
reset: a dropped link, as when a connection to a server is cut while the server lives on.

Its own process because a client library may hold the GIL while it waits on the network
(Mooncake's store binding does): a proxy thread in the test's process would then never
run. `python tcp_proxy.py TARGET_PORT` prints its port; SIGUSR1 drops every connection
open at that moment (both sides see the link end, then a reset) and it forwards new ones
as before.

Each accepted connection is one thread that owns both of its sockets: it connects to the
target (trying again for a while, so a client that connects while the target is still
starting waits instead of being reset), forwards in both directions, and is the only one
to close them. A reset only shuts the sockets down, which wakes that thread; closing a
socket from another thread would leave its descriptor number free for the next accepted
connection while the old thread still reads it, and steal that connection's bytes.
"""

from __future__ import annotations

import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

UPSTREAM_WAIT_S = 10.0  # how long a new connection waits for the target to accept


class TCPProxy:
    """The proxy process in front of 127.0.0.1:`target_port`; `port` is where it listens."""

    def __init__(self, target_port: int) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), str(target_port)],
                                     stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def reset(self) -> None:
        """Drop the connections open now (returns once the proxy has done it)."""
        self.proc.send_signal(signal.SIGUSR1)
        if self.proc.stdout.readline().strip() != "reset":
            raise RuntimeError("the TCP proxy did not confirm the reset")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class _Links:
    """The open connections' sockets, so a reset can shut them down."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()

    def add(self, *socks: socket.socket) -> None:
        with self._lock:
            self._open.update(socks)

    def discard(self, *socks: socket.socket) -> None:
        with self._lock:
            self._open.difference_update(socks)

    def drop_all(self) -> None:
        """Shut every open socket down (its owner thread wakes, closes it, and the peer
        gets a reset: SO_LINGER 0)."""
        with self._lock:
            doomed, self._open = self._open, set()
        for s in doomed:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue  # its owner already closed it


def _connect_upstream(target_port: int) -> socket.socket | None:
    deadline = time.monotonic() + UPSTREAM_WAIT_S
    while True:
        try:
            return socket.create_connection(("127.0.0.1", target_port), timeout=UPSTREAM_WAIT_S)
        except OSError as e:
            if time.monotonic() > deadline:
                print(f"tcp_proxy: 127.0.0.1:{target_port} refused for {UPSTREAM_WAIT_S} s: {e}",
                      file=sys.stderr, flush=True)
                return None
            time.sleep(0.05)


def _forward(client: socket.socket, target_port: int, links: _Links) -> None:
    upstream = _connect_upstream(target_port)
    if upstream is None:
        client.close()
        return
    upstream.settimeout(None)
    links.add(client, upstream)
    peer = {client: upstream, upstream: client}
    with selectors.DefaultSelector() as sel:
        for s in peer:
            sel.register(s, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in sel.select():
                    data = key.fileobj.recv(65536)
                    if not data:
                        return  # one side ended (or a reset shut both down)
                    peer[key.fileobj].sendall(data)
        except OSError:
            return  # a reset while sending: the link is gone
        finally:
            links.discard(client, upstream)
            for s in peer:
                s.close()


def _serve(target_port: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    links = _Links()
    resets: list[int] = []

    def on_reset(signum, frame) -> None:
        resets.append(signum)  # handled on the main thread's next wake-up, below

    signal.signal(signal.SIGUSR1, on_reset)

    def accept() -> None:
        while True:
            client, _ = listener.accept()
            threading.Thread(target=_forward, args=(client, target_port, links), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    while True:
        time.sleep(0.01)
        if resets:
            resets.clear()
            links.drop_all()
            print("reset", flush=True)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
