"""`tokenmill serve -dp 2`'s front: two engine processes behind one real uvicorn on
loopback, driven by the real openai SDK. Greedy chat answers equal one in-process
engine's; two agent sessions of three turns each: every later turn goes to its
session's replica (prefix affinity) and hits that replica's prefix cache. A replica
process killed while each replica streams a request ends the front: both streams end
with a 503 error event within seconds, /health and new requests are 503, and the other
replica's process, asked to stop, exits cleanly (code 0) within `SURVIVOR_STOP_S`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from conftest import TINY_NAME, running_server

from tokenmill.engine.config import EngineArgs
from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.server.app import build_app

ENGINE_KW = {"dtype": "float32", "block_size": 4, "max_num_seqs": 16, "num_kv_blocks": 512}
# A replica asked to stop exits by itself, well before its front's grace (10 s) runs out
# and it is SIGTERMed (exit code -15). It took 0.2-0.6 s with three busy loops beside
# the test; before core/engine/engine_core.py's `_exit` the interpreter's own teardown took
# 0.6-6.8 s there and over 10 s (SIGTERMed) in a loaded full suite.
SURVIVOR_STOP_S = 5.0


def _chat(client: openai.OpenAI, messages: list[dict]) -> str:
    reply = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=6,
                                           temperature=0)
    return reply.choices[0].message.content


def _sessions(url: str) -> list[list[str]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    histories = [[{"role": "user", "content": "Paris is the capital of France; Berlin is"}],
                 [{"role": "user", "content": "def main():\n    return 42"}]]
    answers: list[list[str]] = [[], []]
    for turn in range(3):
        for i, history in enumerate(histories):
            text = _chat(client, history)
            answers[i].append(text)
            history += [{"role": "assistant", "content": text},
                        {"role": "user", "content": f"and then {turn}?"}]
    return answers


async def _kill_while_streaming(url: str, engine: AsyncLLM, victim: int) -> tuple:
    """Stream one long completion on each replica; once both have sent a chunk, SIGKILL
    `victim`. Returns (each stream's lines, when the kill was sent)."""
    streaming = [asyncio.Event(), asyncio.Event()]
    killed_at: list[float] = []

    async def stream(ac: httpx.AsyncClient, i: int) -> list[str]:
        body = {"model": TINY_NAME, "prompt": f"stream {i}: " + "xyz" * (4 + i),
                "max_tokens": 400, "ignore_eos": True, "stream": True}
        lines = []
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                    streaming[i].set()
        return lines

    async def kill() -> None:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streaming)), 60)
        assert engine._client.router.loads == [1, 1]  # one stream on each replica
        os.kill(engine._client.clients[victim].proc.pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
        *streams, _ = await asyncio.gather(stream(ac, 0), stream(ac, 1), kill())
    return streams, killed_at[0]


@pytest.mark.long
def test_serve_dp2_affinity_and_replica_death(tiny_model):
    one = AsyncLLM(EngineArgs(model=str(tiny_model), **ENGINE_KW))
    with running_server(build_app(one, [TINY_NAME])) as url:
        want = _sessions(url)
    one.shutdown()

    engine = AsyncLLM(EngineArgs(model=str(tiny_model), data_parallel_size=2, **ENGINE_KW),
                      engine_process=True)
    try:
        procs = [c.proc for c in engine._client.clients]
        assert len({p.pid for p in procs} | {os.getpid()}) == 3
        with running_server(build_app(engine, [TINY_NAME])) as url, \
                httpx.Client(base_url=url, timeout=30) as c:
            assert _sessions(url) == want
            router = engine._client.router
            # 6 requests: the first turns spread (least loaded), the 4 later ones
            # followed their session's prefix to its replica
            assert router.stats.num_routed == 6 and router.stats.num_affinity == 4
            assert engine.stats.prefix_cache_hits > 0  # the replicas' stats, summed
            assert c.get("/health").status_code == 200

            streams, killed_at = asyncio.run(_kill_while_streaming(url, engine, victim=1))
            # both in-flight requests failed (the survivor's too: the front is gone), fast
            assert time.monotonic() - killed_at < 10, "the streams hung after the kill"
            for lines in streams:
                assert lines[-1] == "data: [DONE]"
                error = json.loads(lines[-2].removeprefix("data: "))["error"]
                assert error["code"] == 503 and "engine is not running" in error["message"]
                assert "died" not in error["message"], error  # the log has the cause
            assert engine.is_dead
            assert c.get("/health").status_code == 503
            late = c.post("/v1/completions", json={"model": TINY_NAME, "prompt": "hi",
                                                   "max_tokens": 2})
            assert late.status_code == 503 and late.json()["error"]["type"] == "server_error"
            # the survivor was asked to stop and did, by itself (its client reaps it: a
            # join from here too would race the client's in waitpid)
            survivor = engine._client.clients[0]
            survivor.wait_exit(max(0.0, killed_at + SURVIVOR_STOP_S - time.monotonic()))
            assert survivor.exitcode == 0, (
                f"the surviving replica did not exit cleanly within {SURVIVOR_STOP_S} s of "
                f"the kill (exit code {survivor.exitcode}; None: still running, -15: "
                "SIGTERMed once its front's grace ran out)")
    finally:
        engine.shutdown()
