"""uvicorn's fast path (httptools + uvloop) is what `tokenmill serve` and these tests run,
and the SSE events it carries are the JSON the APIs define."""

import json
import logging

import pytest

from tokenmill.server import http_server
from tokenmill.server.serving import sse


def test_serving_runs_on_httptools_and_uvloop():
    # both are dependencies of tokenmill: falling back here means the install is wrong
    options = http_server.uvicorn_options()
    assert options["http"] == "httptools"
    assert options["loop"] == "uvloop"


def test_a_missing_fast_path_falls_back_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(http_server, "find_spec", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="tokenmill.server.http_server"):
        options = http_server.uvicorn_options()
    assert (options["http"], options["loop"]) == ("h11", "asyncio")
    assert "httptools is not installed" in caplog.text
    assert "uvloop is not installed" in caplog.text


@pytest.mark.parametrize("event", [None, "content_block_delta"])
def test_sse_events_are_the_json_of_their_data(event):
    data = {"id": "cmpl-1", "choices": [{"index": 0, "text": "L'Étoile ✓ \"q\"\n",
                                         "logprobs": None, "top": {"a": -0.5}}], "n": 3}
    raw = sse(data, event)
    assert isinstance(raw, bytes) and raw.endswith(b"\n\n")
    lines = raw.decode().split("\n")
    if event:
        assert lines.pop(0) == f"event: {event}"
    assert lines[0].startswith("data: ") and lines[1:] == ["", ""]
    payload = lines[0][len("data: "):]
    assert json.loads(payload) == data
    assert list(json.loads(payload)) == list(data)  # keys keep their order
    assert sse("[DONE]") == b"data: [DONE]\n\n"
