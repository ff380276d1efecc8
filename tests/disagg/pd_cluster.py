"""Real `tokenmill serve --kv-role ...` and `tokenmill router` processes on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

BLOCK_SIZE = 4
SERVE_FLAGS = ["--dtype", "float32", "--block-size", str(BLOCK_SIZE),
               "--kv-cache-memory-bytes", str(8 << 20), "--max-num-batched-tokens", "64",
               "--log-level", "warning"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server process and its URL; its output goes to a log file shown on failure."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tokenmill.server.cli", *argv, "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.url} did not start: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL the server and its engine process (its own session's group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def serve(model: Path, role: str, log_dir: Path, *flags: str) -> Proc:
    name = f"{role}-{len(list(log_dir.glob('*.log')))}"
    return Proc(["serve", str(model), "--served-model-name", "tiny", "--kv-role", role,
                 *SERVE_FLAGS, *flags], log_dir / f"{name}.log")


def router(prefill: list[Proc], decode: list[Proc], log_dir: Path) -> Proc:
    return Proc(["router", "--prefill", *[p.url for p in prefill],
                 "--decode", *[d.url for d in decode], "--log-level", "warning"],
                log_dir / f"router-{len(list(log_dir.glob('router*.log')))}.log")


@contextmanager
def cluster(model: Path, log_dir: Path, num_prefill: int = 1, num_decode: int = 1,
            *flags: str) -> Iterator[tuple[Proc, list[Proc], list[Proc]]]:
    """(router, prefill instances, decode instances), all started and ready."""
    procs: list[Proc] = []
    try:
        prefill = [serve(model, "prefill", log_dir, *flags) for _ in range(num_prefill)]
        procs += prefill
        decode = [serve(model, "decode", log_dir, *flags) for _ in range(num_decode)]
        procs += decode
        front = router(prefill, decode, log_dir)
        procs.append(front)
        for p in procs:
            p.wait_ready()
        yield front, prefill, decode
    finally:
        for p in procs:
            p.stop()


def metric(url: str, name: str) -> float:
    """A counter or gauge of an instance's /metrics (summed over its series)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in {url}/metrics"
    return total
