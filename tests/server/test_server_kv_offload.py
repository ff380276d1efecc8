"""KV offload behind the HTTP API: session ids from the OpenAI (`user`, `extra_body`
`session_id`) and Anthropic (`metadata.user_id`) requests reach the engine, a hinted
session's next turn is prefetched, and /metrics carries the per-tier counters."""

from __future__ import annotations

import anthropic
import openai
import pytest
from conftest import TINY_NAME, running_server, scrape, tiny_engine, wait_idle

from tokenmill.server.app import build_app


@pytest.fixture()
def offload_server(tiny_model, tmp_path):
    # a 64-block pool, a 3-object host tier over disk: most history lives on disk
    engine = tiny_engine(tiny_model, num_kv_blocks=64, max_model_len=256,
                         kv_offload_host_bytes="8KiB", kv_offload_disk_path=str(tmp_path),
                         kv_offload_disk_bytes="16MiB")
    with running_server(build_app(engine, [TINY_NAME])) as url:
        yield url, engine
    engine.shutdown()


def turn(client: openai.OpenAI, history: list[dict], text: str, **kw) -> list[dict]:
    history = history + [{"role": "user", "content": text}]
    r = client.chat.completions.create(model=TINY_NAME, messages=history, max_tokens=6,
                                       temperature=0, **kw)
    return history + [{"role": "assistant", "content": r.choices[0].message.content}]


def test_sessions_prefetch_and_tier_metrics(offload_server):
    url, engine = offload_server
    connector = engine.engine.offload.scheduler_side
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    long = "the quick brown fox jumps over the lazy dog"
    a = turn(client, [], "a: " + long, user="agent-a")
    b = turn(client, [], "b: " + long, extra_body={"session_id": "agent-b"})
    wait_idle(engine)
    a = turn(client, a, "and then?", user="agent-a")  # no hint: nothing prefetched
    wait_idle(engine)
    assert connector.num_prefetched == 0

    def push_out():  # other sessions take the device pool: b's and c's blocks leave it
        for i in range(3):
            turn(client, [], f"{i}: " + long * 2, user=f"other-{i}")
            wait_idle(engine)

    push_out()
    engine.hint_session("agent-b")  # as the server does when a turn ends in a tool call
    turn(client, b, "tool result: ok", extra_body={"session_id": "agent-b"})
    wait_idle(engine)
    after_b = connector.num_prefetched
    assert after_b > 0  # b's history came up from disk before its turn was admitted
    messages = anthropic.Anthropic(base_url=url, api_key="x")
    for hint in (False, True):
        if hint:
            push_out()
            engine.hint_session("agent-c")
        messages.messages.create(model=TINY_NAME, max_tokens=4, metadata={"user_id": "agent-c"},
                                 messages=[{"role": "user", "content": "c: " + long}])
        wait_idle(engine)
    assert connector.num_prefetched > after_b  # Anthropic's metadata.user_id names it

    samples = scrape(url)
    def tier(name, t):
        return samples[(f"tokenmill:kv_offload_{name}_total", (("tier", t),))]
    stack = engine.engine.offload.stack
    for t in ("host", "disk"):
        assert tier("bytes_written", t) == stack.stats[t].bytes_written > 0
        for name, attr in (("hits", "hits"), ("bytes_read", "bytes_read"),
                           ("bytes_promoted", "bytes_promoted"), ("tokens_loaded", "tokens_loaded"),
                           ("corrupt_objects", "corrupt"), ("errors", "errors"),
                           ("tokens_recompute_chosen", "tokens_recompute_chosen")):
            assert tier(name, t) == getattr(stack.stats[t], attr), (name, t)
        assert tier("tokens_recomputed", t) == 0
    assert tier("hits", "disk") > 0 and tier("bytes_promoted", "host") > 0  # the prefetches


def test_offload_with_the_engine_in_its_own_process(tiny_model, tmp_path):
    """`tokenmill serve`'s layout: session ids and the tool-call hint cross the ZMQ link to
    the engine core, and the tiers' counters come back in its SchedulerStats."""
    from tokenmill.engine.config import EngineArgs
    from tokenmill.frontend.async_engine import AsyncLLM

    engine = AsyncLLM(EngineArgs(
        model=str(tiny_model), dtype="float32", block_size=4, num_kv_blocks=64,
        max_model_len=256, kv_offload_host_bytes="8KiB", kv_offload_disk_path=str(tmp_path),
        kv_offload_disk_bytes="16MiB",
    ), engine_process=True)
    try:
        with running_server(build_app(engine, [TINY_NAME])) as url:
            assert engine.engine is None  # no model in this process
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
            long = "the quick brown fox jumps over the lazy dog"
            b = turn(client, [], "b: " + long, extra_body={"session_id": "agent-b"})
            wait_idle(engine)
            for i in range(3):  # other sessions push b's blocks out of the device and host
                turn(client, [], f"{i}: " + long * 2, user=f"other-{i}")
                wait_idle(engine)
            before = scrape(url)
            engine.hint_session("agent-b")
            turn(client, b, "tool result: ok", extra_body={"session_id": "agent-b"})
            wait_idle(engine)
            after = scrape(url)

            def delta(name, tier):
                key = (f"tokenmill:kv_offload_{name}_total", (("tier", tier),))
                return after[key] - before[key]
            loaded_blocks = delta("tokens_loaded", "disk") // 4
            assert loaded_blocks > 0  # b's history came back from disk
            # the hinted prefetch copied b's first blocks into the host (the hint crossed
            # to the engine process; without it nothing is promoted), and the load read
            # them from there
            assert delta("bytes_promoted", "host") > 0
            assert delta("tokens_loaded", "host") > 0
    finally:
        engine.shutdown()


def test_a_bad_object_on_disk_does_not_take_the_server_down(tiny_model, tmp_path):
    """`tokenmill serve`'s layout, restarted over a disk tier whose every object was
    replaced by a well-framed one of the wrong size (before the size check, one such
    object failed every request that reached it with 503, a restart included): the same
    chat answers 200 with the same text, /health stays 200, and the bad objects read are
    gone."""
    import httpx

    from tokenmill.engine.config import EngineArgs
    from tokenmill.frontend.async_engine import AsyncLLM
    from tokenmill.kv_connector.objects import ObjectCodec

    def serve():
        return AsyncLLM(EngineArgs(
            model=str(tiny_model), dtype="float32", block_size=4, num_kv_blocks=64,
            max_model_len=256, kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes="16MiB",
        ), engine_process=True)

    long = "the quick brown fox jumps over the lazy dog " * 3
    answers = []
    for restart in range(2):
        engine = serve()
        try:
            with running_server(build_app(engine, [TINY_NAME])) as url:
                client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
                answers.append(turn(client, [], long)[-1]["content"])
                wait_idle(engine)
                assert httpx.get(f"{url}/health").status_code == 200
        finally:
            engine.shutdown()
        if restart == 0:
            files = sorted(tmp_path.glob("*/*/*.kv"))
            assert files
            size = files[0].stat().st_size // 2
            for f in files:
                f.write_bytes(ObjectCodec(size).encode(bytes.fromhex(f.stem), bytes(size)))
    assert answers[1] == answers[0]
    # the bad objects the load read are gone (their blocks recomputed and saved again)
    assert sum(f.stat().st_size != size + 96 for f in files if f.exists()) >= 1
