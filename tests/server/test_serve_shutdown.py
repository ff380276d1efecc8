"""`tokenmill serve` as a user runs it (the default GGUF model), stopped with Ctrl-C (SIGINT
to its whole process group): it exits 0, and its log holds no traceback, no leaked
semaphore warning and no size in a unit other than GiB."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from conftest import free_port


@pytest.mark.slow
@pytest.mark.long  # two minutes: serves the default model; .ci/run's quick start checks the same stop
def test_ctrl_c_stops_serve_cleanly_and_its_log_speaks_gib(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.server.cli", "serve", "--port", str(port),
           "--max-model-len", "512"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path,
                            start_new_session=True, env={**os.environ, "TOKENMILL_API_KEY": ""})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.5)
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi!"}]})
        assert answer.status_code == 200, answer.text
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
        output = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output
    assert "Traceback" not in output and "leaked semaphore" not in output, output
    sizes = re.findall(r"\d[\d.,]* ?(bytes|[KMT]iB|[KMGT]B)\b", output)
    assert not sizes, f"sizes not in GiB: {sizes}\n{output}"
    assert "GiB" in output  # the KV pool's size is logged
