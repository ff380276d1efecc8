"""/metrics: counters move by exactly what the requests sent, gauges fall back to idle."""

from __future__ import annotations

import uuid

import httpx
import pytest
from conftest import TINY_NAME, scrape, wait_idle


def delta(before: dict, after: dict, name: str, labels=()) -> float:
    return after.get((name, labels), 0) - before.get((name, labels), 0)


def test_counters_match_requests(tiny_server):
    base_url, engine = tiny_server
    wait_idle(engine)
    before = scrape(base_url)
    usages = []
    with httpx.Client(base_url=base_url, timeout=60) as c:
        for i, max_tokens in enumerate((3, 5, 7)):
            body = {"model": TINY_NAME, "prompt": f"The quick brown fox {i}",
                    "max_tokens": max_tokens, "ignore_eos": True}
            usages.append(c.post("/v1/completions", json=body).json()["usage"])
        body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "n": 2,
                "max_tokens": 4, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        usages.append(httpx.Response(200, content=lines[-1][6:]).json()["usage"])
        body = {"model": TINY_NAME, "max_tokens": 6, "messages": [{"role": "user", "content": "x"}],
                "stop_sequences": ["zzzz"]}
        msg = c.post("/v1/messages", json=body).json()["usage"]
        usages.append({"prompt_tokens": msg["input_tokens"] + msg["cache_read_input_tokens"],
                       "completion_tokens": msg["output_tokens"]})
    wait_idle(engine)
    after = scrape(base_url)

    assert delta(before, after, "tokenmill:prompt_tokens_total") == sum(
        u["prompt_tokens"] for u in usages)
    assert delta(before, after, "tokenmill:generation_tokens_total") == sum(
        u["completion_tokens"] for u in usages)
    finished = sum(
        delta(before, after, "tokenmill:request_success_total", (("finished_reason", r),))
        for r in ("stop", "length"))
    assert finished == 5
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(before, after, f"tokenmill:{hist}_count") == 5
    # n=2 streams two sequences: every generated token after a sequence's first is one gap
    gaps = sum(u["completion_tokens"] for u in usages) - 6
    assert delta(before, after, "tokenmill:inter_token_latency_seconds_count") == gaps
    assert delta(before, after, "tokenmill:prefix_cache_queries_total") > 0
    assert after[("tokenmill:num_requests_running", ())] == 0
    assert after[("tokenmill:num_requests_waiting", ())] == 0
    assert after[("tokenmill:kv_cache_usage_perc", ())] == 0
    # the per-type split: a plain model has one type, idle now
    assert after[("tokenmill:kv_blocks_in_use", (("attention_type", "full"),))] == 0
    assert after[("tokenmill:kv_blocks_usable", ())] > 0
    assert ("tokenmill:num_preemptions_total", ()) in after
    assert ("tokenmill:prefix_cache_hits_total", ()) in after


def test_prefix_cache_hits_match_cached_tokens(tiny_server):
    base_url, engine = tiny_server
    wait_idle(engine)
    before = scrape(base_url)
    body = {"model": TINY_NAME, "max_tokens": 2,
            "prompt": f"{uuid.uuid4().hex}: " + "one step at a time. " * 8}  # never seen before
    with httpx.Client(base_url=base_url, timeout=60) as c:
        cached = [c.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]
                  ["cached_tokens"] for _ in range(2)]
    wait_idle(engine)
    after = scrape(base_url)
    assert cached[0] == 0 and cached[1] > 0
    assert delta(before, after, "tokenmill:prefix_cache_hits_total") == sum(cached)


def test_roofline_gauges_count_the_model_flops_against_the_platform_peak(tiny_server, tiny_model):
    """The core reads the platform's hardware spec (tokenmill_hardware_spec) and shows each
    step's model FLOP/s and bytes/s as fractions of its peaks. The FLOPs of a request are
    the model's, counted here by hand from its config: 2 x every projection's weights per
    token, 2 x the LM head per sampled row, 4 h d per attended (query, key) pair."""
    from transformers import AutoConfig

    from tokenmill.platforms.registry import load_platform

    base_url, engine = tiny_server
    wait_idle(engine)
    before = scrape(base_url)
    with httpx.Client(base_url=base_url, timeout=60) as c:
        usage = c.post("/v1/completions", json={
            "model": TINY_NAME, "prompt": f"{uuid.uuid4().hex} roofline", "max_tokens": 4,
            "ignore_eos": True}).json()["usage"]
    wait_idle(engine)
    after = scrape(base_url)
    hf = AutoConfig.from_pretrained(tiny_model)
    h, heads, kv = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads
    d = h // heads
    per_token = 2 * hf.num_hidden_layers * (
        h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * hf.intermediate_size)
    p, k = usage["prompt_tokens"], usage["completion_tokens"]
    tokens = p + k - 1  # the last sampled token is never fed back
    pairs = sum(range(1, tokens + 1))
    expected = (tokens * per_token + k * 2 * h * hf.vocab_size
                + hf.num_hidden_layers * 4 * heads * d * pairs)
    counted = delta(before, after, "tokenmill:model_flops_total")
    assert abs(counted / expected - 1) < 0.1, (counted, expected)
    assert delta(before, after, "tokenmill:model_bytes_total") > 0
    spec = load_platform("cpu").hardware_spec()
    flops_per_s = after[("tokenmill:model_flops_per_second", ())]
    utilization = after[("tokenmill:model_flops_utilization", ())]
    peak = spec.peak_flops["float32"]  # the tiny server runs float32 (conftest)
    assert flops_per_s > 0 and 0 < utilization <= 1
    assert utilization == pytest.approx(flops_per_s / peak)
    assert 0 < after[("tokenmill:memory_bandwidth_utilization", ())] <= 1
