"""More families and topologies through real processes on loopback (`tokenmill serve
--kv-role ...` + `tokenmill router`, the real OpenAI and Anthropic SDKs): 2P1D and 1P2D as
well as 1P1D, for the families test_pd_servers.py does not run (llama and qwen3_next run
there). Each cluster: concurrent single requests, a batch and a stream greedy identical
to a colocated engine; the same prompts again (the router sends them to the decode
instance that holds them: a decode-side prefix hit, blocks skipped) identical too; every
request handed over, every lease released. Then, on 1P2D llama, a decode instance killed
mid-stream under the Anthropic SDK: the stream fails with the route's 503 error
(`overloaded_error`), the leases are freed, and the surviving instance answers the next
request identically."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
from pd_cluster import BLOCK_SIZE, cluster, metric

from tokenmill import LLM, SamplingParams
from tokenmill_conformance.tiny_models import make_tiny_model

pytestmark = pytest.mark.long  # a cluster of server processes per case: minutes

MAX_NEW = 6
PROMPTS = [[(7 * i + 3 * j) % 250 + 5 for j in range(n)] for i, n in enumerate([13, 22, 9])]
# (family, prefill instances, decode instances): every family once, both topologies twice
CASES = [("gemma3", 2, 1), ("gpt_oss", 1, 2), ("kimi_linear", 1, 1), ("bamba", 2, 1),
         ("deepseek_v3", 1, 2)]


def _colocated(model, prompts) -> list[str]:
    llm = LLM(str(model), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=512)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    llm.engine.shutdown()
    return texts


def _complete(url: str, prompt, **kw):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW,
                                      temperature=0, extra_body={"ignore_eos": True}, **kw)


def _total(procs, name: str) -> float:
    return sum(metric(p.url, name) for p in procs)


def _leases_released(prefill) -> None:
    deadline = time.monotonic() + 10  # releases are sent in the background
    while _total(prefill, "tokenmill:kv_handover_leases_held"):
        assert time.monotonic() < deadline, "the prefill instances still hold leases"
        time.sleep(0.2)


@pytest.mark.parametrize("case", CASES, ids=[f"{a}-{p}P{d}D" for a, p, d in CASES])
def test_family_through_servers_identical_to_colocated(case, tmp_path):
    arch, num_prefill, num_decode = case
    model = make_tiny_model(tmp_path / "model", arch)
    texts = _colocated(model, PROMPTS)
    with cluster(model, tmp_path, num_prefill, num_decode) as (front, prefill, decode):
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: spread by load
            singles = list(pool.map(lambda p: _complete(front.url, p).choices[0].text,
                                    PROMPTS))
        assert singles == texts
        batch = _complete(front.url, PROMPTS)
        assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == texts
        stream = _complete(front.url, PROMPTS[1], stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == texts[1]
        skipped = _total(decode, "tokenmill:kv_handover_blocks_skipped_total")
        again = [_complete(front.url, p).choices[0].text for p in PROMPTS]
        assert again == texts  # with a decode-side prefix hit
        assert _total(decode, "tokenmill:kv_handover_blocks_skipped_total") > skipped
        # every request was handed over: none computed its prompt on a decode instance
        n = 3 * len(PROMPTS) + 1
        assert _total(prefill, "tokenmill:kv_handover_offered_total") == n
        assert _total(decode, "tokenmill:kv_handover_received_total") == n
        assert _total(decode, "tokenmill:kv_handover_failed_total") == 0
        _leases_released(prefill)


def _serving(decode) -> object:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for d in decode:
            if metric(d.url, "tokenmill:num_requests_running") > 0:
                return d
        time.sleep(0.05)
    raise AssertionError("no decode instance reports a running request mid-stream")


def test_anthropic_stream_fails_with_503_when_its_decode_instance_dies(tmp_path):
    model = make_tiny_model(tmp_path / "model", "llama")
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 8192  # long enough for the kill to land mid-stream
    (model / "config.json").write_text(json.dumps(config))
    (expected,) = _colocated(model, PROMPTS[:1])
    with cluster(model, tmp_path, 1, 2) as (front, prefill, decode):
        with anthropic.Anthropic(base_url=front.url, api_key="unused", max_retries=0) as client:
            with pytest.raises(anthropic.APIError, match="decode instance failed") as failed:
                with client.messages.stream(
                    model="tiny", max_tokens=8000,
                    messages=[{"role": "user", "content": "a long answer"}],
                    extra_body={"ignore_eos": True},
                ) as stream:
                    chunks = iter(stream.text_stream)
                    next(chunks)
                    _serving(decode).kill()
                    for _ in chunks:
                        pass
        assert "overloaded_error" in str(failed.value.body)  # Anthropic's 503 shape
        _leases_released(prefill)
        assert _complete(front.url, PROMPTS[0]).choices[0].text == expected
