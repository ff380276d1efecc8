"""The workload a plan serves: prompt and output lengths, how much of each prompt the
prefix cache already holds, and the load (an arrival rate, a number of concurrent
clients, or as much as the deployment sustains).

`--workload` takes `isl=4000,osl=500[,rate=2][,concurrency=64][,hit=0.5]` or a trace:
Mooncake's JSON lines (`{"timestamp": ms, "input_length", "output_length", "hash_ids"}`,
512-token blocks) or a recorded agent session (`{"block_size", "requests": [{"t", "in",
"out", "hash_ids"}]}`, the `../shared/traces/claude-code` files) or a directory of them.
From a trace: mean lengths, the load (a Mooncake trace's arrival rate over its span; agent
sessions are clients in a closed loop, one request at a time each: concurrency = the
number of sessions), and the prefix-hit rate: the
share of prompt tokens in leading blocks whose hash ids an earlier request of the same
scope already sent (a hit is as long as its first miss), as a cache large enough to keep
everything would serve them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Workload:
    isl: int  # prompt tokens per request
    osl: int  # output tokens per request
    hit_rate: float = 0.0  # share of prompt tokens the prefix cache serves
    rate: float | None = None  # requests/s offered; None: as many as sustainable
    concurrency: int | None = None  # closed loop: this many clients, each one request at a time
    source: str = ""

    @property
    def new_tokens(self) -> int:
        """Prompt tokens each request computes (past its prefix hit), at least one."""
        return max(1, round(self.isl * (1.0 - self.hit_rate)))

    def describe(self) -> str:
        load = (f"{self.rate:g} req/s" if self.rate else
                f"{self.concurrency} concurrent" if self.concurrency else "max sustainable")
        hit = f", prefix hits {self.hit_rate:.0%}" if self.hit_rate else ""
        src = f" from {self.source}" if self.source else ""
        return f"ISL {self.isl} / OSL {self.osl}{hit}, {load}{src}"


def parse_workload(text: str) -> Workload:
    path = Path(text)
    if path.exists():
        return from_trace(path)
    values: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep:
            raise ValueError(f"workload {text!r}: write isl=N,osl=N[,rate=R][,concurrency=N]"
                             "[,hit=F] or give a trace file")
        values[key.strip().lower()] = value.strip()
    unknown = set(values) - {"isl", "osl", "rate", "concurrency", "hit"}
    if unknown or not {"isl", "osl"} <= set(values):
        raise ValueError(f"workload {text!r}: needs isl and osl; unknown keys {sorted(unknown)}")
    hit = float(values.get("hit", 0))
    if not 0 <= hit < 1:
        raise ValueError(f"workload hit={hit} must be in [0, 1)")
    workload = Workload(int(values["isl"]), int(values["osl"]), hit,
                        float(values["rate"]) if "rate" in values else None,
                        int(values["concurrency"]) if "concurrency" in values else None)
    if workload.isl < 1 or workload.osl < 1:
        raise ValueError(f"workload {text!r}: isl and osl must be at least 1")
    return workload


def from_trace(path: Path) -> Workload:
    """Lengths, rate and prefix-hit rate of a Mooncake trace or agent session(s)."""
    files = sorted(path.glob("*.json*")) if path.is_dir() else [path]
    requests: list[tuple[float, int, int, int]] = []  # (time s, in, out, hit tokens)
    sessions = 0
    for file in files:
        if file.suffix == ".jsonl":
            requests += _mooncake(file)
        elif file.suffix == ".json":
            requests += _session(file)
            sessions += 1
    if not requests:
        raise ValueError(f"{path}: no requests found (expected Mooncake .jsonl or session .json)")
    n = len(requests)
    span = max(r[0] for r in requests) - min(r[0] for r in requests)
    isl = sum(r[1] for r in requests) / n
    return Workload(
        isl=round(isl), osl=max(1, round(sum(r[2] for r in requests) / n)),
        hit_rate=sum(r[3] for r in requests) / max(1, sum(r[1] for r in requests)),
        rate=n / span if span > 0 and not sessions else None,
        concurrency=sessions or None,
        source=path.name,
    )


def _hits(hash_ids: list, block: int, length: int, seen: set) -> int:
    """Tokens of the leading blocks already seen (a prefix hit ends at its first miss)."""
    hit = 0
    for h in hash_ids:
        if h not in seen:
            break
        hit += 1
    seen.update(hash_ids)
    return min(hit * block, length)


def _mooncake(file: Path) -> list[tuple[float, int, int, int]]:
    seen: set = set()
    out = []
    for line in file.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        hit = _hits(r.get("hash_ids", []), 512, r["input_length"], seen)
        out.append((r["timestamp"] / 1000.0, r["input_length"], r["output_length"], hit))
    return out


def _session(file: Path) -> list[tuple[float, int, int, int]]:
    data = json.loads(file.read_text())
    if "requests" not in data:
        raise ValueError(f"{file}: not an agent session trace (no 'requests')")
    block = int(data.get("block_size", 64))
    seen: set = set()
    out = []
    for r in data["requests"]:
        hit = _hits(r.get("hash_ids", []), block, r["in"], seen)
        out.append((float(r.get("t", 0.0)), r["in"], r["out"], hit))
    return out
