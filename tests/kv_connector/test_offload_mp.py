"""KV offload with the worker in its own process (the "mp" executor).

The connector's worker side runs in the worker process over its arena; the scheduler
side runs in the engine over a mirror of the worker's tier stack (directory.py), fed only
by what the step and result messages carry. A short replay of recorded Claude Code
sessions on a pool far smaller than their working set must give the same greedy output
and compute the same prompt tokens per turn as the in-process ("uni") executor, and the
tier counters that reach the engine must equal uni's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from test_trace_replay import BS, MAX_LEN, load_requests, replay

from tokenmill import LLM
from tokenmill.kv_connector.directory import TierDirectory

SESSIONS = 3  # of test_trace_replay's six: a short replay
POOL = MAX_LEN // BS  # 128 blocks: one longest request


def offloading(path: str, disk: str, backend: str) -> LLM:
    return LLM(path, dtype="float32", block_size=BS, num_kv_blocks=POOL, max_model_len=MAX_LEN,
               kv_offload_host_bytes="256KiB", kv_offload_disk_path=disk,
               kv_offload_disk_bytes="64MiB", distributed_executor_backend=backend)


def test_mp_offload_computes_what_uni_computes(tiny_dirs, tmp_path):
    path = str(tiny_dirs["llama"])
    uni = offloading(path, str(tmp_path / "uni"), "uni")
    vocab = uni.engine.loaded.hf_config.vocab_size
    sessions = sorted({r["session"] for r in load_requests(vocab)})[:SESSIONS]
    requests = [r for r in load_requests(vocab) if r["session"] in sessions]
    expected = replay(uni, requests)
    uni.engine.drain_kv_offload()
    uni_stats = uni.engine.offload.snapshot()
    uni.engine.shutdown()

    mp = offloading(path, str(tmp_path / "mp"), "mp")
    assert mp.engine.offload.worker_side is None  # nothing of the worker's in this process
    assert isinstance(mp.engine.offload.directory, TierDirectory)
    got = replay(mp, requests)
    mp.engine.drain_kv_offload()
    mp_stats = mp.engine.offload.snapshot()
    mp.engine.shutdown()

    assert [r["output"] for r in got] == [r["output"] for r in expected]
    assert [r["computed"] for r in got] == [r["computed"] for r in expected]
    assert sum(r["computed"] for r in got) < sum(len(r["prompt"]) for r in got) // 2
    # the run went through the tiers (device and host hold it together: no disk loads)
    assert mp_stats["host"].tokens_loaded > 0
    for tier in ("host", "disk"):
        for field in ("bytes_written", "tokens_loaded", "tokens_recomputed", "hits"):
            assert getattr(mp_stats[tier], field) == getattr(uni_stats[tier], field), (tier, field)


def test_mp_engine_seeds_its_mirror_from_the_disk_tier(tiny_dirs, tmp_path):
    """A new engine with worker processes on a disk directory an earlier engine filled:
    its mirror starts with those objects, and the first request loads them."""
    disk = str(tmp_path / "disk")
    prompt = list(range(5, 5 + 40))
    script = textwrap.dedent(f"""
        from tokenmill import LLM, SamplingParams
        llm = LLM({str(tiny_dirs["llama"])!r}, dtype="float32", block_size={BS},
                  num_kv_blocks=64, kv_offload_disk_path={disk!r},
                  kv_offload_disk_bytes="16MiB")
        out = llm.generate({{"prompt_token_ids": {prompt!r}}},
                           SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        llm.engine.drain_kv_offload()
        print("TOKENS", list(out[0].outputs[0].token_ids))
    """)
    first = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=300, check=True)
    tokens = next(line for line in first.stdout.splitlines() if line.startswith("TOKENS"))

    from tokenmill import SamplingParams

    llm = LLM(str(tiny_dirs["llama"]), dtype="float32", block_size=BS, num_kv_blocks=64,
              kv_offload_disk_path=disk, kv_offload_disk_bytes="16MiB",
              distributed_executor_backend="mp")
    assert llm.engine.offload.directory.num_held("disk") == len(prompt) // BS
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)[0]
    assert f"TOKENS {list(out.outputs[0].token_ids)}" == tokens
    assert out.num_cached_tokens == (len(prompt) - 1) // BS * BS  # all but the last block
    llm.engine.drain_kv_offload()
    assert llm.engine.offload.snapshot()["disk"].tokens_loaded == out.num_cached_tokens
    llm.engine.shutdown()
