"""A loopback TCP proxy, in a process of its own, whose open connections a test can
reset: a dropped link, as when a connection to a server is cut while the server lives on.

Its own process because a client library may hold the GIL while it waits on the network
(Mooncake's store binding does): a proxy thread in the test's process would then never
run. `python tcp_proxy.py TARGET_PORT` prints its port; SIGUSR1 aborts every connection
open at that moment (RST both ways) and it forwards new ones as before.
"""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path


class TCPProxy:
    """The proxy process in front of 127.0.0.1:`target_port`; `port` is where it listens."""

    def __init__(self, target_port: int) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), str(target_port)],
                                     stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def reset(self) -> None:
        """Abort the connections open now (returns once the proxy has done it)."""
        self.proc.send_signal(signal.SIGUSR1)
        if self.proc.stdout.readline().strip() != "reset":
            raise RuntimeError("the TCP proxy did not confirm the reset")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass  # reset or closed: the other direction ends too
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already gone


def _serve(target_port: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    lock = threading.Lock()
    open_sockets: list[socket.socket] = []
    resets: list[int] = []

    def on_reset(signum, frame) -> None:
        resets.append(signum)  # handled on the main thread's next wake-up, below

    signal.signal(signal.SIGUSR1, on_reset)

    def accept() -> None:
        while True:
            client, _ = listener.accept()
            try:
                upstream = socket.create_connection(("127.0.0.1", target_port))
            except OSError:
                client.close()
                continue
            with lock:
                open_sockets.extend((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    while True:
        time.sleep(0.01)
        if resets:
            resets.clear()
            with lock:
                doomed = open_sockets[:]
                open_sockets.clear()
            for s in doomed:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            print("reset", flush=True)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
