"""A request the engine fails (finish_reason "error") is a 500 in the API's error shape, or
an error event mid-stream; the engine and the other requests go on."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from conftest import TINY_NAME, running_server, tiny_engine

from tokenmill.server.app import build_app

MARKER = "EXPLODE"


@pytest.fixture(scope="module")
def failing_server(tiny_model):
    """A server whose frontend fails any request whose prompt contains MARKER, the way a bug
    in output processing would (the per-request isolation catches it and aborts the
    request in the engine core)."""
    engine = tiny_engine(tiny_model)
    outputs = engine.outputs
    apply = outputs._apply

    def maybe_fail(parent, seq, delta):
        if MARKER in (parent.prompt or ""):
            raise RuntimeError("injected failure")
        return apply(parent, seq, delta)

    outputs._apply = maybe_fail
    with running_server(build_app(engine, [TINY_NAME])) as url:
        yield url, engine
    engine.shutdown()


def chat(text: str, **kw) -> dict:
    return {"model": TINY_NAME, "messages": [{"role": "user", "content": text}],
            "max_tokens": 8, **kw}


def test_failed_request_is_a_500_and_others_go_on(failing_server, caplog):
    url, engine = failing_server
    caplog.set_level(logging.ERROR, logger="tokenmill.server")
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/chat/completions", json=chat(f"please {MARKER} now"))
        assert r.status_code == 500
        err = r.json()["error"]
        # the internal text stays in the log, with the id the client gets
        rid = r.headers["x-request-id"]
        assert "injected failure" not in err["message"] and err["type"] == "server_error"
        assert f"request id {rid}" in err["message"]
        assert any(rid in rec.getMessage() and "injected failure" in rec.getMessage()
                   for rec in caplog.records)
        r = client.post("/v1/messages", json=chat(f"{MARKER}!"))
        assert r.status_code == 500
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
        ok = client.post("/v1/chat/completions", json=chat("hello there"))
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert not engine.is_dead


def test_failed_request_ends_its_stream_with_an_error_event(failing_server):
    url, _ = failing_server
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions",
                           json=chat(f"{MARKER} stream", stream=True)) as r:
            assert r.status_code == 200
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        message = json.loads(data[-2])["error"]["message"]
        assert "injected failure" not in message
        assert f"request id {r.headers['x-request-id']}" in message
        with client.stream("POST", "/v1/messages", json=chat(f"{MARKER}", stream=True)) as r:
            lines = list(r.iter_lines())
        events = [line[7:] for line in lines if line.startswith("event: ")]
        assert events[-1] == "error"
        ok = client.post("/v1/messages", json=chat("hello there"))
        assert ok.status_code == 200 and ok.json()["stop_reason"] == "max_tokens"
