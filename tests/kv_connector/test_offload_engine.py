"""KV offload through the engine: agent-like sessions round-robin over a device pool that
holds about one of them, with the rest of their history in the tiers.

The guarantees checked, each against a run with an unlimited pool and no offload:
greedy output identical; prompt tokens computed per turn <= the turn's new tokens + one
block; bytes written per tier == the unique blocks of all sessions (nothing saved twice);
a corrupt disk file and a killed Redis still give identical output (recomputing only
what could not be loaded); a new engine process on the same disk directory reuses it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.kv.hashing import hash_blocks

BS = 4
NUM_SESSIONS, NUM_TURNS, FIRST, NEW, OUT = 3, 3, 40, 6, 8
GREEDY = SamplingParams(temperature=0, max_tokens=OUT, ignore_eos=True)


def make_llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BS, **kw)


def tight(path, **kw) -> LLM:
    # 24 blocks = 96 tokens: one session's longest context (~90 tokens), not three
    return make_llm(path, num_kv_blocks=24, max_model_len=96, **kw)


def session_turns(seed: int = 0):
    """Yields (session, turn, user tokens); each turn's prompt is the session's history
    (earlier prompts and outputs) plus new user tokens, as an agent resends it."""
    rng = random.Random(seed)
    for turn in range(NUM_TURNS):
        for s in range(NUM_SESSIONS):
            yield s, turn, [rng.randrange(5, 200) for _ in range(FIRST if turn == 0 else NEW)]


def replay(llm: LLM, turns=None) -> list[dict]:
    """Run the sessions turn by turn; per turn its prompt, output and tokens computed."""
    history: dict[int, list[int]] = {}
    kv_context: dict[int, int] = {}  # tokens whose KV the previous turn computed
    records = []
    for s, turn, user in turns or session_turns():
        prompt = history.get(s, []) + user
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
        tokens = out.outputs[0].token_ids
        records.append({
            "session": s, "turn": turn, "prompt": prompt, "output": tokens,
            "computed": len(prompt) - out.num_cached_tokens,
            "new": len(prompt) - kv_context.get(s, 0),
        })
        history[s] = prompt + tokens
        kv_context[s] = len(prompt) + len(tokens) - 1  # the last sampled token was never fed
    return records


def unique_blocks(records: list[dict]) -> int:
    """Distinct full blocks over every turn's computed context (prompt + outputs but the last)."""
    keys = set()
    for r in records:
        keys.update(hash_blocks(r["prompt"] + r["output"][:-1], BS))
    return len(keys)


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    return replay(make_llm(tiny_dirs["llama"], num_kv_blocks=1024))  # unlimited here


def test_sessions_never_recompute_a_previous_turn(tiny_dirs, reference, tmp_path):
    llm = tight(tiny_dirs["llama"], kv_offload_host_bytes="64KiB",
                kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes="16MiB")
    records = replay(llm)
    assert [r["output"] for r in records] == [r["output"] for r in reference]
    assert llm.engine.scheduler.num_preemptions == 0
    for r in records[NUM_SESSIONS:]:  # every later turn: only its new tokens (+ a block)
        assert r["computed"] <= r["new"] + BS, r
    offload = llm.engine.offload
    stats = offload.stack.stats
    # the device pool alone could not have held the history: the tiers supplied it
    assert stats["host"].tokens_loaded + stats["disk"].tokens_loaded > 0
    # the 64 KiB host tier holds what the device evicted (21 of the 54 blocks), most of
    # what came back; older ones came from disk
    assert stats["host"].tokens_loaded > stats["disk"].tokens_loaded > 0
    unique = unique_blocks(records) * offload.layout.object_bytes
    llm.engine.offload.worker_side.drain()
    assert stats["disk"].bytes_written == unique  # write-through, each block once
    assert 0 < stats["host"].bytes_written  # moved in by evictions, not saved
    assert stats["host"].tokens_recomputed == stats["disk"].tokens_recomputed == 0
    # exclusive placement: no block is both cached on the device and held by the host
    pool = llm.engine.kv.pool
    device = {offload.scheduler_side.key(b.block_hash) for b in pool.blocks
              if b.block_hash is not None}
    assert device and not device & set(offload.stack.host.keys())


def test_without_offload_the_tight_pool_recomputes(tiny_dirs, reference):
    """The control: the same replay without tiers computes whole histories again."""
    records = replay(tight(tiny_dirs["llama"]))
    assert [r["output"] for r in records] == [r["output"] for r in reference]
    assert any(r["computed"] > r["new"] + BS for r in records[NUM_SESSIONS:])


def test_corrupt_file_and_killed_redis_give_identical_output(
    tiny_dirs, reference, tmp_path, redis_server
):
    llm = tight(tiny_dirs["llama"], kv_offload_disk_path=str(tmp_path),
                kv_offload_disk_bytes="16MiB", kv_offload_remote=redis_server.url)
    turns = list(session_turns())
    records = replay(llm, turns[:NUM_SESSIONS])  # first turns: every block saved
    stack = llm.engine.offload.stack
    llm.engine.offload.worker_side.drain()
    disk = stack.tier("disk")
    files = sorted(disk.file_for(k) for k in disk.keys())
    for f in files[::3]:  # corrupt a third of the disk copies: redis still has them
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
    history = {r["session"]: r["prompt"] + r["output"] for r in records}
    for s, turn, user in turns[NUM_SESSIONS : 2 * NUM_SESSIONS]:
        out = llm.generate({"prompt_token_ids": history[s] + user}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference[turn * NUM_SESSIONS + s]["output"]
        history[s] = history[s] + user + out.outputs[0].token_ids
    assert stack.stats["disk"].corrupt > 0 and stack.stats["redis"].tokens_loaded > 0
    # now the remote tier disappears, and the disk copies are all corrupt
    redis_server.kill()
    for f in sorted(disk.file_for(k) for k in disk.keys()):
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0xFF
        f.write_bytes(bytes(raw))
    for s, turn, user in turns[2 * NUM_SESSIONS :]:
        out = llm.generate({"prompt_token_ids": history[s] + user}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference[turn * NUM_SESSIONS + s]["output"]
        history[s] = history[s] + user + out.outputs[0].token_ids
    assert stack.stats["disk"].tokens_recomputed > 0 and stack.stats["redis"].errors > 0


_RESTART = textwrap.dedent("""
    import json, sys
    from tokenmill import LLM, SamplingParams
    path, disk, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=24, max_model_len=96,
              kv_offload_disk_path=disk, kv_offload_disk_bytes="16MiB")
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    stats = llm.engine.offload.stack.stats["disk"]
    print(json.dumps({"output": out.outputs[0].token_ids, "cached": out.num_cached_tokens,
                      "loaded": stats.tokens_loaded}))
""")


def test_a_new_process_reuses_the_disk_tier(tiny_dirs, reference, tmp_path):
    llm = tight(tiny_dirs["llama"], kv_offload_disk_path=str(tmp_path),
                kv_offload_disk_bytes="16MiB")
    first = reference[0]
    out = llm.generate({"prompt_token_ids": first["prompt"]}, GREEDY, use_tqdm=False)[0]
    llm.engine.offload.worker_side.drain()
    assert out.outputs[0].token_ids == first["output"]
    second = reference[NUM_SESSIONS]  # session 0's next turn
    proc = subprocess.run(
        [sys.executable, "-c", _RESTART, str(tiny_dirs["llama"]), str(tmp_path),
         json.dumps(second["prompt"])],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["output"] == second["output"]
    assert got["loaded"] == got["cached"] >= (len(first["prompt"]) + OUT - 1) // BS * BS


def test_the_cost_model_recomputes_what_loads_slower_with_the_same_output(
    tiny_dirs, reference, tmp_path
):
    """With loads priced slower than the prefill (a tiny model behind a slow link), the
    cost model recomputes every hit instead: the output is the reference's, nothing is
    loaded, and the tokens it chose to recompute are counted per tier. Priced the other
    way, the same replay loads."""
    llm = tight(tiny_dirs["llama"], kv_offload_host_bytes="64KiB",
                kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes="16MiB")
    cost = llm.engine.offload.scheduler_side.cost
    cost.bandwidth = {"host": 1.0, "disk": 1.0}  # bytes/s: nothing is worth loading
    cost.seconds_per_token = 1e-3
    records = replay(llm)
    assert [r["output"] for r in records] == [r["output"] for r in reference]
    stats = llm.engine.offload.stack.stats
    assert sum(s.tokens_loaded for s in stats.values()) == 0
    assert sum(s.tokens_recompute_chosen for s in stats.values()) > 0
    cost.bandwidth = {"host": 1e12, "disk": 1e12}
    for r in replay(llm, [(s, 0, list(range(100 + s, 140 + s))) for s in (10, 11)]):
        assert r["computed"] == 40  # new sessions: nothing held yet
    before = sum(s.tokens_loaded for s in stats.values())
    assert llm.engine.kv.reset_prefix_cache()  # the device's blocks move to the host
    replay(llm, [(10, 1, list(range(110, 150)) + [9])])
    assert sum(s.tokens_loaded for s in stats.values()) > before


def test_fp8_kv_sessions_offload_their_fp8_pages(tiny_dirs, tmp_path):
    """An FP8 KV cache offloads as it is: in the tight pool, with host and disk tiers,
    the sessions give the greedy output of an FP8 engine with an unlimited pool, later
    turns compute only their new tokens, and each disk object carries FP8 pages (a quarter
    of the float32 engine's payload). The layout's fingerprint names the dtype: a float32
    engine on the same disk directory loads none of the FP8 objects."""
    fp8 = dict(kv_cache_dtype="fp8")
    want = replay(make_llm(tiny_dirs["llama"], num_kv_blocks=1024, **fp8))
    llm = tight(tiny_dirs["llama"], kv_offload_host_bytes="16KiB",
                kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes="16MiB", **fp8)
    records = replay(llm)
    assert [r["output"] for r in records] == [r["output"] for r in want]
    for r in records[NUM_SESSIONS:]:
        assert r["computed"] <= r["new"] + BS, r
    stats = llm.engine.offload.stack.stats
    assert stats["host"].tokens_loaded + stats["disk"].tokens_loaded > 0
    layout = llm.engine.offload.layout
    llm.engine.offload.worker_side.drain()
    assert stats["disk"].bytes_written == unique_blocks(records) * layout.object_bytes
    llm.engine.shutdown()

    plain = tight(tiny_dirs["llama"], kv_offload_disk_path=str(tmp_path),
                  kv_offload_disk_bytes="16MiB")
    assert layout.fingerprint() != plain.engine.offload.layout.fingerprint()
    assert layout.payload_bytes * 4 == plain.engine.offload.layout.payload_bytes
    first = records[NUM_SESSIONS]  # a turn whose history the FP8 engine saved
    out = plain.generate({"prompt_token_ids": first["prompt"]}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # nothing of the FP8 engine's is read as float32
    assert plain.engine.offload.stack.stats["disk"].tokens_loaded == 0
    plain.engine.shutdown()
