"""Faults through the real router and SDK clients, 2P2D processes on loopback (llama):

- a decode instance killed mid-stream ends the client's stream with a 503 error in the
  route's shape, and the prefill instances' leases are freed;
- the next request goes to the surviving decode instance, output identical;
- a prefill instance killed: the router prefills on the other one, output identical;
- both killed: the decode instance computes the prompt itself, output identical;
- a handshake with an incompatible instance (another model) is refused naming the
  mismatch.
"""

from __future__ import annotations

import json
import time

import httpx
import msgspec
import openai
import pytest
from pd_cluster import BLOCK_SIZE, cluster, metric, serve

from tokenmill import LLM, SamplingParams
from tokenmill.server.pd import PrefillReply
from tokenmill_conformance.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.long,  # engine pairs or server processes for prefill and decode: minutes
    pytest.mark.xdist_group("pd_faults"),  # a module-scoped setup: one xdist worker
]

PROMPT = [(5 * j) % 200 + 7 for j in range(11)]
MAX_NEW = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-faults")
    model = make_tiny_model(root / "model", "llama")
    # a context long enough that the mid-stream kill below lands while decode still runs,
    # however fast the machine (400 tokens took under a second on CI)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (model / "config.json").write_text(json.dumps(config))
    colocated = LLM(str(model), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=512)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    text = colocated.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)[0]
    colocated.engine.shutdown()
    with cluster(model, root, 2, 2) as (front, prefill, decode):
        yield root, front, prefill, decode, text.outputs[0].text


def _complete(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_NEW,
                                    temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def _running(url: str) -> float:
    return metric(url, "tokenmill:num_requests_running")


def _serving_decode(decode: list) -> object:
    """The decode instance computing the streamed request (its gauge is published per step)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for d in decode:
            if _running(d.url) > 0:
                return d
        time.sleep(0.05)
    raise AssertionError("no decode instance reports a running request mid-stream")


def test_faults_in_order(setup):
    root, front, prefill, decode, expected = setup
    assert _complete(front.url) == expected

    # a decode instance dies mid-stream: the stream ends with a 503 error event
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a long answer"}],
        max_tokens=8000, temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    serving = _serving_decode(decode)
    serving.kill()
    with pytest.raises(openai.APIError, match="decode instance failed"):
        for _ in chunks:
            pass
    deadline = time.monotonic() + 10
    while sum(metric(p.url, "tokenmill:kv_handover_leases_held") for p in prefill):
        assert time.monotonic() < deadline, "the prefill instances still hold leases"
        time.sleep(0.2)

    # the other decode instance takes the next requests
    assert _complete(front.url) == expected
    # a prefill instance dies: the other one prefills
    prefill[0].kill()
    assert _complete(front.url) == expected
    prefill[1].kill()
    # none left: the decode instance computes the prompt itself
    assert _complete(front.url) == expected
    routed = httpx.get(front.url + "/metrics").text
    assert 'tokenmill_router_requests_total{route="decode_only"} 1.0' in routed


def test_incompatible_handshake_is_refused_naming_the_mismatch(setup, tmp_path):
    root, front, prefill, decode, _ = setup
    other = make_tiny_model(tmp_path / "other", "qwen2")
    stranger = serve(other, "prefill", root)
    try:
        stranger.wait_ready()
        survivor = next(d for d in decode if d.proc.poll() is None)
        offer = httpx.post(stranger.url + "/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 4},
            headers={"x-tokenmill-pd": "prefill"}, timeout=60)
        assert offer.status_code == 200
        reply = msgspec.msgpack.decode(offer.content, type=PrefillReply)
        answer = httpx.post(survivor.url + "/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 4},
            headers={"x-tokenmill-pd": f"decode {stranger.url} {reply.lease_ids[0]}"},
            timeout=60)
        assert answer.status_code == 400
        message = answer.json()["error"]["message"]
        assert "model:" in message and "cannot hand its KV over" in message
    finally:
        stranger.stop()
