"""A bounded burst against the waiting-queue bound: 200 chat requests at once on loopback.

`tokenmill serve`'s stack (uvicorn, the engine core in its own process, the default model)
with `--max-num-seqs 16` and the default `--max-waiting-requests` (64). All 200 requests
are sent together (one connection each); the server admits what can run or wait and
answers the rest 429 at once, with a Retry-After. Reported: how many of each status, how
fast the refusals came, the Retry-After values, how long the admitted requests took (the
last one ends when the full queue has drained), and /health's latency during the burst.

    python benchmarks/bench_burst_429.py [--requests 200] [--max-tokens 32]

Prints a Markdown table (docs/server.md).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import socket
import statistics
import threading
import time

import httpx
import uvicorn

from tokenmill.engine.config import EngineArgs
from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.server.admission import DEFAULT_MAX_WAITING_REQUESTS
from tokenmill.server.app import build_app
from tokenmill.server.http_server import uvicorn_options

NAME = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def burst(url: str, num: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=num + 8, max_keepalive_connections=num + 8)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        done = asyncio.Event()

        async def health() -> list[float]:
            out = []
            while not done.is_set():
                t = time.perf_counter()
                await client.get("/health")
                out.append(time.perf_counter() - t)
                await asyncio.sleep(0.1)
            return out

        async def one(i: int) -> tuple[int, float, str | None]:
            t = time.perf_counter()
            r = await client.post("/v1/chat/completions", json={
                "model": NAME, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Tell me a fact about the number {i}."}]})
            return r.status_code, time.perf_counter() - t, r.headers.get("retry-after")

        probe = asyncio.create_task(health())
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(one(i) for i in range(num)))
        total = time.perf_counter() - t0
        done.set()
        return {"answers": answers, "total": total, "health": await probe}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    args = ap.parse_args()
    engine = AsyncLLM(EngineArgs(max_num_seqs=args.max_num_seqs, num_kv_blocks=4096),
                      engine_process=True)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, [NAME]), host="127.0.0.1", port=port,
                                           log_level="warning", **uvicorn_options()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(burst(url, 1, args.max_tokens))  # warm up
        result = asyncio.run(burst(url, args.requests, args.max_tokens))
    finally:
        server.should_exit = True
        thread.join(60)
    answers = result["answers"]
    counts = collections.Counter(status for status, _, _ in answers)
    refused = [s for status, s, _ in answers if status == 429]
    admitted = [s for status, s, _ in answers if status == 200]
    retry = collections.Counter(r for status, _, r in answers if status == 429)
    health = result["health"]
    print(f"{args.requests} requests at once, max_tokens {args.max_tokens}, --max-num-seqs "
          f"{args.max_num_seqs}, --max-waiting-requests {DEFAULT_MAX_WAITING_REQUESTS}\n")
    print("| what | value |")
    print("|---|---|")
    print(f"| answered 200 / 429 / other | {counts[200]} / {counts[429]} / "
          f"{sum(v for k, v in counts.items() if k not in (200, 429))} |")
    if refused:
        print(f"| 429 latency, median / max | {statistics.median(refused) * 1e3:.0f} ms / "
              f"{max(refused) * 1e3:.0f} ms |")
        print(f"| Retry-After values (s: count) | "
              f"{', '.join(f'{k}: {v}' for k, v in sorted(retry.items()))} |")
    if admitted:
        print(f"| admitted requests' latency, median / max (the queue drained) | "
              f"{statistics.median(admitted):.1f} s / {max(admitted):.1f} s |")
    print(f"| /health during the burst, median / max ({len(health)} probes) | "
          f"{statistics.median(health) * 1e3:.0f} ms / {max(health) * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
