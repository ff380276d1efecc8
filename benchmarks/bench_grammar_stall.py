"""Does a new grammar stall the streams already running? The inter-token gaps of one
running stream while 10 hard grammars arrive, through the real server.

`tokenmill serve`'s stack on loopback (uvicorn, the engine core in its own process, the
default model). One completion streams 96 tokens; once it has 32, ten requests arrive
together, each with its own hard JSON schema (an anyOf of 60 objects of 20 integer
properties: ~0.1-0.2 s to compile with this vocabulary, every one new to both caches) and a
two-token prompt (so their prefill costs nothing and what is measured is the grammar).
The stream's gaps are reported before the grammars arrive, while any is unanswered, and
after; the claim is that the longest gap while they are unanswered stays within 2x the
median.

    python benchmarks/bench_grammar_stall.py [--grammars 10] [--repeats 3]

Prints a Markdown table (docs/server.md). On a shared machine the gaps also carry the
neighbours' load: each repeat is a fresh server, and every repeat is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time

import httpx
import uvicorn

from tokenmill.engine.config import EngineArgs
from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.server.app import build_app
from tokenmill.server.http_server import uvicorn_options

NAME = "smollm2"


def hard_schema(seed: int) -> dict:
    """An anyOf of 60 objects of 20 integer properties, unique to `seed`."""
    return {"anyOf": [
        {"type": "object", "properties": {f"s{seed}_k{j}_{i}": {"type": "integer"}
                                          for i in range(20)},
         "required": [f"s{seed}_k{j}_0"], "additionalProperties": False}
        for j in range(60)]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           **uvicorn_options()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


async def one_run(url: str, num_grammars: int, seed: int, tokens: int, fire_at: int) -> dict:
    """Stream `tokens` tokens; at token `fire_at`, send the grammars. The stream's gaps
    split by when they end: before the grammars arrive, while any is unanswered, after."""
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        arrivals: list[float] = []
        answered: list[float] = []
        grammar_tasks: list[asyncio.Task] = []
        body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}

        async def grammar(i: int) -> int:
            r = await client.post("/v1/completions", json={
                "model": NAME, "prompt": "Hi", "max_tokens": 8, "temperature": 0,
                "structured_outputs": {"json": hard_schema(seed * 100 + i)}})
            answered.append(time.perf_counter())
            return r.status_code

        t_fire = 0.0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                arrivals.append(time.perf_counter())
                if len(arrivals) == fire_at:
                    t_fire = time.perf_counter()
                    grammar_tasks = [asyncio.create_task(grammar(i)) for i in range(num_grammars)]
        statuses = await asyncio.gather(*grammar_tasks)
    t_done = max(answered)
    gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:])]
    return {"gaps": [g for _, g in gaps],
            "before": [g for t, g in gaps if t <= t_fire],
            "during": [g for t, g in gaps if t_fire < t <= t_done],
            "after": [g for t, g in gaps if t > t_done],
            "answered_s": t_done - t_fire, "statuses": sorted(set(statuses))}


def _ms(gaps: list[float]) -> str:
    return f"{max(gaps) * 1e3:.0f}" if gaps else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grammars", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--fire-at", type=int, default=32)
    args = ap.parse_args()
    rows = []
    for rep in range(args.repeats):
        engine = AsyncLLM(EngineArgs(num_kv_blocks=2048), engine_process=True)
        server, thread, url = serve(build_app(engine, [NAME]))
        try:  # warm: the first request pays setup (llguidance's vocabulary, kernels)
            asyncio.run(one_run(url, 1, 999 + rep, 24, 8))
            result = asyncio.run(one_run(url, args.grammars, rep, args.tokens, args.fire_at))
        finally:
            server.should_exit = True
            thread.join(60)
        rows.append((rep, result))
    print(f"| run | median gap (ms) | longest before (ms) | longest while the {args.grammars} "
          "grammars are unanswered (ms) | longest after (ms) | while / median | "
          "grammars answered in (s), status |")
    print("|---|---|---|---|---|---|---|")
    for rep, r in rows:
        median = statistics.median(r["gaps"])
        during = max(r["during"]) / median if r["during"] else float("nan")
        print(f"| {rep + 1} | {median * 1e3:.0f} | {_ms(r['before'])} | {_ms(r['during'])} | "
              f"{_ms(r['after'])} | {during:.2f} | {r['answered_s']:.1f}, "
              f"{json.dumps(r['statuses'])} |")


if __name__ == "__main__":
    main()
