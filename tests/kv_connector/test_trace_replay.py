"""Replay of recorded Claude Code sessions (../shared/traces/claude-code) with KV offload,
on a device pool about a quarter of the sessions' working set.

Scaling: every length and the trace's 64-token block are divided by 64, so each trace
hash id becomes one token (seeded by (trace, hash id)) and the prefix sharing between a
session's requests is kept exactly; prompts are cut at their scaled length, outputs at
8 tokens; requests past the tiny model's 512-token context are dropped. Requests run one
at a time in the order of their scaled start times, sessions interleaved.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.kv.hashing import hash_blocks

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces" / "claude-code"
SESSIONS = ["trace_0026", "trace_0057", "trace_0103", "trace_0165", "trace_0187", "trace_0288"]
FACTOR, BS, MAX_LEN, MAX_OUT = 64, 4, 512, 8


def load_requests(vocab: int) -> list[dict]:
    if not TRACES.is_dir():
        pytest.fail(f"the recorded traces are missing: {TRACES} (../shared beside the repo)")
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
            prompt = [token_of[h] for h in req["hash_ids"][:n_in]]
            requests.append({"session": name, "t": req["t"], "prompt": prompt, "max": n_out,
                             "stop": req["stop"]})
    requests.sort(key=lambda r: (r["t"], r["session"]))
    return requests


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def replay(llm: LLM, requests: list[dict]) -> list[dict]:
    contexts: dict[str, list[list[int]]] = {}  # session -> token lists whose KV was computed
    records = []
    for req in requests:
        params = SamplingParams(temperature=0, max_tokens=req["max"], ignore_eos=True)
        out = llm.generate({"prompt_token_ids": req["prompt"]}, params, use_tqdm=False)[0]
        tokens = out.outputs[0].token_ids
        seen = max((common_prefix(req["prompt"], c) for c in contexts.get(req["session"], [])),
                   default=0)
        records.append({**req, "output": tokens, "new": len(req["prompt"]) - seen,
                        "computed": len(req["prompt"]) - out.num_cached_tokens})
        contexts.setdefault(req["session"], []).append(req["prompt"] + tokens[:-1])
    return records


def test_claude_code_replay_with_a_quarter_size_pool(tiny_dirs, tmp_path):
    path = str(tiny_dirs["llama"])
    unlimited = LLM(path, dtype="float32", block_size=BS, num_kv_blocks=4096)
    requests = load_requests(unlimited.engine.loaded.hf_config.vocab_size)
    reference = replay(unlimited, requests)
    working_set = {h for r in reference for h in hash_blocks(r["prompt"] + r["output"][:-1], BS)}
    pool = MAX_LEN // BS  # one longest request: 128 blocks
    assert pool * 3.5 < len(working_set)  # a pool far smaller than what the sessions hold

    llm = LLM(path, dtype="float32", block_size=BS, num_kv_blocks=pool, max_model_len=MAX_LEN,
              kv_offload_host_bytes="256KiB", kv_offload_disk_path=str(tmp_path),
              kv_offload_disk_bytes="64MiB")
    records = replay(llm, requests)
    assert [r["output"] for r in records] == [r["output"] for r in reference]
    assert llm.engine.scheduler.num_preemptions == 0
    for r in records:
        assert r["computed"] <= r["new"] + BS, {k: r[k] for k in ("session", "t", "new", "computed")}
    offload = llm.engine.offload
    offload.worker_side.drain()
    stats = offload.stack.stats
    unique = len(working_set) * offload.layout.object_bytes
    assert stats["disk"].bytes_written == unique  # write-through, each block once
    assert stats["host"].bytes_written > 0  # what the device evicted moved there
    assert stats["host"].tokens_loaded > 0
    assert stats["host"].tokens_recomputed == stats["disk"].tokens_recomputed == 0
    # the control: the same pool without tiers computes earlier turns again
    control = replay(LLM(path, dtype="float32", block_size=BS, num_kv_blocks=pool,
                         max_model_len=MAX_LEN), requests)
    assert [r["output"] for r in control] == [r["output"] for r in reference]
    recomputed = sum(max(0, r["computed"] - r["new"]) for r in control)
    assert recomputed > 4 * sum(max(0, r["computed"] - r["new"]) for r in records)
    print(f"\n{len(records)} requests, working set {len(working_set)} blocks, pool {pool}: "
          f"prompt tokens computed {sum(r['computed'] for r in records)} with offload "
          f"({stats['host'].tokens_loaded} loaded from host, {stats['disk'].tokens_loaded} "
          f"from disk), {sum(r['computed'] for r in control)} without; new tokens "
          f"{sum(r['new'] for r in records)}")
