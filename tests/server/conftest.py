"""A real uvicorn server on a free loopback port, serving a tiny random model."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from tokenmill.engine.config import EngineArgs
from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.server.app import build_app
from tokenmill.server.http_server import uvicorn_options

TINY_NAME = "tiny-llama"
API_KEY = "sk-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(app) -> Iterator[str]:
    """Serve `app` with uvicorn in a background thread; yields the base URL."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level=os.environ.get("TOKENMILL_TEST_UVICORN_LOG", "warning"),
        timeout_graceful_shutdown=5, **uvicorn_options(),  # what `tokenmill serve` runs
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def tiny_engine(path, **kw) -> AsyncLLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 64)
    kw.setdefault("num_kv_blocks", 4096)  # 16k tokens: plenty, and quick to allocate
    return AsyncLLM(EngineArgs(model=str(path), **kw))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("server-tiny") / "llama", "llama")


@pytest.fixture(scope="session")
def tiny_server(tiny_model) -> Iterator[tuple[str, AsyncLLM]]:
    """(base URL, engine) of a server with no API key, shared by the whole session."""
    engine = tiny_engine(tiny_model)
    # bursts of up to 200 sequences (the load tests) queue rather than get 429s
    with running_server(build_app(engine, [TINY_NAME], max_waiting_requests=256)) as url:
        yield url, engine


@pytest.fixture(scope="session")
def base_url(tiny_server) -> str:
    return tiny_server[0]


@pytest.fixture()
def http(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


def wait_idle(engine: AsyncLLM, timeout_s: float = 10.0) -> None:
    """Wait until the engine has nothing running or waiting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = engine.stats
        if s.num_running == 0 and s.num_waiting == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine still busy after {timeout_s}s: {engine.stats}")


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels without model_name): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples
