"""Replay of the recorded Claude Code sessions (../shared/traces/claude-code) through
`tokenmill router` on 1P1D, against a colocated `tokenmill serve`, all real processes on
loopback serving the same tiny random model (docs/disaggregation.md has the table).

Scaled as tests/kv_connector/test_trace_replay.py scales them: lengths and the trace's
64-token block divided by 64 (each hash id one token), prompts cut at their scaled
length, outputs at 8 tokens (ignore_eos), requests past the 512-token context dropped;
requests run one at a time in the order of their start times, sessions interleaved.

Checks, per request: the output equals the colocated one; the prompt tokens computed
(prompt - cached, as the usage reports them) are at most the tokens no earlier prompt of
the session shares + one block. Measures TTFT and inter-token latency (streamed chunks)
of each deployment in the same run, and the decode instance's handover counters.

    python benchmarks/bench_pd_replay.py [--arch llama] [--max-requests N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "claude-code"
SESSIONS = ["trace_0026", "trace_0057", "trace_0103", "trace_0165", "trace_0187", "trace_0288"]
FACTOR, BS, MAX_LEN, MAX_OUT = 64, 4, 512, 8
FLAGS = ["--dtype", "float32", "--block-size", str(BS), "--kv-cache-memory-bytes",
         str(32 << 20), "--max-num-batched-tokens", "128", "--log-level", "warning",
         "--served-model-name", "tiny"]


def load_requests(vocab: int) -> list[dict]:
    requests = []
    for name in SESSIONS:
        trace = json.loads((TRACES / f"{name}.json").read_text())
        token_of: dict[int, int] = {}
        for req in trace["requests"]:
            n_in = min(max(1, round(req["in"] / FACTOR)), len(req["hash_ids"]))
            n_out = min(MAX_OUT, max(1, round(req["out"] / FACTOR)))
            if n_in + n_out > MAX_LEN:
                continue
            for h in req["hash_ids"]:
                token_of.setdefault(h, random.Random(f"{name}/{h}").randrange(5, vocab))
            requests.append({"session": name, "t": req["t"], "max": n_out,
                             "prompt": [token_of[h] for h in req["hash_ids"][:n_in]]})
    requests.sort(key=lambda r: (r["t"], r["session"]))
    return requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tokenmill.server.cli", *argv, "--port", str(port)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{self.url} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        sys.exit(f"{self.url} did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)


def stream_one(client: httpx.Client, url: str, req: dict) -> dict:
    body = {"model": "tiny", "prompt": req["prompt"], "max_tokens": req["max"],
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, text, usage = [], [], None
    with client.stream("POST", url + "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    stamps.append(time.perf_counter())
                    text.append(choice["text"])
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"text": "".join(text), "ttft": stamps[0] - start if stamps else float("nan"),
            "itl": gaps, "computed": usage["prompt_tokens"] - cached}


def replay(url: str, requests: list[dict]) -> list[dict]:
    out = []
    seen: dict[str, list[list[int]]] = {}
    with httpx.Client(timeout=300) as client:
        for req in requests:
            rec = stream_one(client, url, req)
            shared = max((_common(req["prompt"], p) for p in seen.get(req["session"], [])),
                         default=0)
            rec["new"] = len(req["prompt"]) - shared
            seen.setdefault(req["session"], []).append(req["prompt"])
            out.append(rec)
    return out


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def summary(records: list[dict]) -> tuple[float, float, float]:
    ttft = [r["ttft"] for r in records]
    itl = [g for r in records for g in r["itl"]]
    return statistics.median(ttft), statistics.mean(ttft), statistics.median(itl)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--max-requests", type=int, default=0, help="0: every request")
    parser.add_argument("--kv-transport", default="nixl", choices=["nixl", "mooncake"])
    args = parser.parse_args()
    from tokenmill_conformance.tiny_models import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="pd-replay-"))
    model = make_tiny_model(root / "model", args.arch)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    requests = load_requests(vocab)
    if args.max_requests:
        requests = requests[: args.max_requests]
    serve = ["serve", str(model), *FLAGS]
    colocated = Proc(serve, root / "colocated.log")
    pd = ["--kv-transport", args.kv_transport]
    prefill = Proc([*serve, "--kv-role", "prefill", *pd], root / "prefill.log")
    decode = Proc([*serve, "--kv-role", "decode", *pd], root / "decode.log")
    procs = [colocated, prefill, decode]
    try:
        for p in procs:
            p.wait_ready()
        router = Proc(["router", "--prefill", prefill.url, "--decode", decode.url,
                       "--log-level", "warning"], root / "router.log")
        procs.append(router)
        router.wait_ready()
        base = replay(colocated.url, requests)
        split = replay(router.url, requests)
        same = sum(a["text"] == b["text"] for a, b in zip(base, split, strict=True))
        within = sum(r["computed"] <= r["new"] + BS for r in split)
        moved = metric(decode.url, "tokenmill:kv_handover_transport_bytes_total")
        pulled = metric(decode.url, "tokenmill:kv_handover_blocks_pulled_total")
        skipped = metric(decode.url, "tokenmill:kv_handover_blocks_skipped_total")
        seconds = metric(decode.url, "tokenmill:kv_handover_transfer_seconds_total")
        c, s = summary(base), summary(split)
        print(f"{len(requests)} requests ({args.arch}, block {BS}, {args.kv_transport}): outputs identical "
              f"{same}/{len(requests)}; computed <= new + 1 block on 1P1D {within}/{len(requests)}")
        print(f"prompt tokens: new {sum(r['new'] for r in split)}, computed colocated "
              f"{sum(r['computed'] for r in base)}, 1P1D {sum(r['computed'] for r in split)}")
        print("| deployment | TTFT median (ms) | TTFT mean (ms) | ITL median (ms) |")
        print("|---|---|---|---|")
        print(f"| colocated | {c[0] * 1e3:.1f} | {c[1] * 1e3:.1f} | {c[2] * 1e3:.2f} |")
        print(f"| 1P1D via router | {s[0] * 1e3:.1f} | {s[1] * 1e3:.1f} | {s[2] * 1e3:.2f} |")
        print(f"| ratio 1P1D / colocated | {s[0] / c[0]:.2f} | {s[1] / c[1]:.2f} | "
              f"{s[2] / c[2]:.2f} |")
        print(f"handover: {moved:.0f} bytes moved by the transport, {pulled:.0f} blocks pulled, "
              f"{skipped:.0f} skipped (the decode side's prefix cache), {seconds:.2f} s in pulls; "
              f"TTFT added per request {(s[1] - c[1]) * 1e3:.1f} ms mean")
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    main()
