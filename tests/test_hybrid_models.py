"""Gemma 3 and gpt-oss end to end through `LLM` on the CPU plugin, against transformers.

Tiny random models (sliding windows of 8 tokens, blocks of 4, prompts up to ~50 tokens,
so every sliding layer reads only part of its context) must produce transformers' greedy
tokens for single requests, mixed batches under a small token budget (chunked prefill
beside decodes), preemption, and prefix caching cold vs warm. The logit-level checks
(one step, chunks, ragged batches) are in test_model_equivalence.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig

from tokenmill import LLM, SamplingParams
from tokenmill.platforms.ops.reference import ReferenceAttentionBackend
from tokenmill_conformance.tiny_models import make_tokenizer

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "héllo wörld, naïve café, 你好世界 🙂 and then some more words to make this one long",
    "def main():\n    return 42\n tokenmill turns any accelerator into tokens, one step at a time.",
]
SHARED = "Paris is the capital of France; Berlin is the capital of Germany. The quick brown fox "

_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    sliding_window=8,
    eos_token_id=2,
    bos_token_id=None,
    pad_token_id=0,
)


def _config(arch: str, vocab_size: int):
    if arch == "gemma3":
        return Gemma3TextConfig(
            **_COMMON,
            vocab_size=vocab_size,
            intermediate_size=128,
            num_hidden_layers=4,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=30.0,
        )
    return GptOssConfig(
        **_COMMON,
        vocab_size=vocab_size,
        intermediate_size=32,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0,
        },
    )


@pytest.fixture(scope="module", params=["gemma3", "gpt_oss"])
def tiny(request, tmp_path_factory):
    """(arch, checkpoint dir, the transformers model) of one tiny random architecture."""
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    tokenizer = make_tokenizer(300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch, len(tokenizer)), dtype=torch.float32)
    with torch.no_grad():
        # peaked distributions, so greedy is not decided by float noise between near ties
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
            elif name.endswith("bias") or name.endswith("sinks"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return arch, path, hf.eval()


_HF_CACHE: dict[tuple[str, tuple[int, ...]], list[int]] = {}
_HF_MAX_NEW = 24


def _hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation (computed once per checkpoint and prompt: a shorter
    greedy continuation is a prefix of a longer one). Keyed by the checkpoint's directory,
    never by id(model): CPython reuses a freed model's id for the next family's model."""
    key = (model.config.name_or_path, tuple(prompt_ids))
    if key not in _HF_CACHE:
        ids = torch.tensor([prompt_ids])
        out = []
        with torch.no_grad():
            for _ in range(max(max_new, _HF_MAX_NEW)):
                nxt = int(model(ids).logits[0, -1].argmax())
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        _HF_CACHE[key] = out
    return _HF_CACHE[key][:max_new]


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, **kw)


def _expect(hf, llm: LLM, prompts: list[str], outs, max_new: int) -> None:
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, tok.encode(prompt), max_new), prompt


def test_single_requests_and_backends(tiny, caplog):
    arch, path, hf = tiny
    with caplog.at_level(logging.WARNING, logger="tokenmill.model.layers"):
        llm = _llm(path)
    model = llm.engine.executor.worker.runner.model
    backends = {type(b) for b in model.attention_backends}
    if arch == "gpt_oss":
        # the CPU plugin has no sinks: every layer falls back to the reference, and says so
        assert backends == {ReferenceAttentionBackend}
        assert "no sinks" in caplog.text
    else:
        # the fast path must run: the plugin's own backends, sliding and full
        assert ReferenceAttentionBackend not in backends
        names = {b.name for b in model.attention_backends}
        assert names == {"cpu_sdpa_full", "cpu_sdpa_sliding_window"}
    for prompt in PROMPTS:
        _expect(hf, llm, [prompt], llm.generate([prompt], _greedy(), use_tqdm=False), 12)


def test_mixed_batch_under_small_token_budget(tiny):
    _, path, hf = tiny
    # a budget of 8 splits prompts into chunks and mixes them with decodes
    llm = _llm(path, max_num_batched_tokens=8, max_num_seqs=3, enable_prefix_caching=False)
    _expect(hf, llm, PROMPTS, llm.generate(PROMPTS, _greedy(10), use_tqdm=False), 10)


def test_preemption_keeps_greedy_outputs(tiny):
    _, path, hf = tiny
    # 64 blocks of one layer each (every KV group here has one layer); chunks of 16
    tight = _llm(path, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=16)
    prompts = PROMPTS
    outs = tight.generate(prompts, _greedy(24), use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    _expect(hf, tight, prompts, outs, 24)
    assert tight.engine.kv.usage == 0.0


def test_prefix_cache_cold_and_warm(tiny):
    _, path, hf = tiny
    llm = _llm(path)
    prompts = [SHARED + s for s in ("def main():", "héllo wörld", "one step at a time")]
    cold = llm.generate(prompts[0], _greedy(), use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    warm = llm.generate(prompts[1:], _greedy(), use_tqdm=False)
    n_shared = len(llm.get_tokenizer().encode(SHARED))
    for out in warm:
        assert out.num_cached_tokens >= (n_shared - 4) // 4 * 4 > 8  # more than a window
    again = llm.generate(prompts[0], _greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(cold.prompt_token_ids) - 1) // 4 * 4
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    _expect(hf, llm, prompts, [cold, *warm], 12)


def test_windows_hold_only_their_blocks(tiny):
    """While requests run, each sliding-window group holds only the blocks its next query
    reads; full attention holds the whole context."""
    _, path, hf = tiny
    llm = _llm(path, max_num_batched_tokens=16)
    engine = llm.engine
    kv = engine.kv
    windows = [g.sliding_window for g in kv.groups]
    assert None in windows and 8 in windows
    prompt = llm.get_tokenizer().encode(PROMPTS[3] + PROMPTS[2])
    assert len(prompt) > 40
    engine.add_request("long", prompt, _greedy(20))
    request = engine.scheduler.requests["long"]
    outputs, max_held = [], 0
    while engine.has_unfinished_requests():
        outputs += engine.step()
        if request.is_finished:
            break
        computed = request.num_computed_tokens
        for window, held in zip(windows, kv.num_blocks_held(request), strict=True):
            if window is None:
                assert held == -(-computed // 4)
            else:
                # the window's blocks plus at most one chunk of 16 and the block in progress
                assert held <= -(-(window + 16) // 4) + 1
                max_held = max(max_held, held)
    assert max_held and kv.usage == 0.0
    tokens = [o for o in outputs if o.finished][0].outputs[0].token_ids
    assert tokens == _hf_greedy(hf, prompt, 20)


def _offload_sessions(seed: int = 0):
    """3 sessions x 3 turns: 40 tokens, then 6 new ones a turn after the history."""
    import random

    rng = random.Random(seed)
    for turn in range(3):
        for s in range(3):
            yield s, [rng.randrange(5, 290) for _ in range(40 if turn == 0 else 6)]


def _offload_replay(llm: LLM) -> list[dict]:
    history: dict[int, list[int]] = {}
    records = []
    for s, user in _offload_sessions():
        prompt = history.get(s, []) + user
        out = llm.generate({"prompt_token_ids": prompt}, _greedy(8), use_tqdm=False)[0]
        tokens = out.outputs[0].token_ids
        records.append({"output": tokens, "computed": len(prompt) - out.num_cached_tokens,
                        "new": len(user) + (8 if s in history else 0) - (1 if s in history else 0)})
        history[s] = prompt + tokens
    return records


def test_kv_offload_saves_and_loads_every_kv_group(tiny, tmp_path):
    """Sliding-window groups beside full attention: each group's blocks are objects of
    their own. On a pool that holds one session of three, later turns load their history
    from host + disk: greedy output equals an unlimited pool's, and each turn computes at
    most its new tokens + one block (a window needs only the blocks it reads at the hit,
    so it is loaded with fewer objects than full attention). Corrupt disk objects, read
    by a new engine, still give the same output (a failed load computes instead)."""
    _, path, _ = tiny
    reference = _offload_replay(_llm(path, num_kv_blocks=1024))
    tight = dict(num_kv_blocks=48, max_model_len=96, max_num_batched_tokens=16)
    offload = dict(kv_offload_host_bytes="64KiB", kv_offload_disk_path=str(tmp_path),
                   kv_offload_disk_bytes="16MiB")
    llm = _llm(path, **tight, **offload)
    groups = llm.engine.kv.groups
    assert len(groups) > 1 and any(g.sliding_window for g in groups)
    records = _offload_replay(llm)
    assert [r["output"] for r in records] == [r["output"] for r in reference]
    for r in records[3:]:
        assert r["computed"] <= r["new"] + 4, r
    llm.engine.drain_kv_offload()
    stats = llm.engine.offload.snapshot()
    # device and host hold different blocks (together, most of the history here)
    assert stats["host"].tokens_loaded + stats["disk"].tokens_loaded > 0
    assert stats["host"].tokens_recomputed == stats["disk"].tokens_recomputed == 0
    # a window's objects: only those inside its window at the hit are read
    num_full = sum(1 for g in groups if g.sliding_window is None)
    read = stats["host"].hits + stats["disk"].hits
    loaded_positions = (stats["host"].tokens_loaded + stats["disk"].tokens_loaded) // 4
    assert loaded_positions * num_full < read < loaded_positions * len(groups)
    # the control: the same pool without tiers computes earlier turns again
    control = _offload_replay(_llm(path, **tight))
    assert [r["output"] for r in control] == [r["output"] for r in reference]
    assert sum(r["computed"] for r in control) > 2 * sum(r["computed"] for r in records)
    llm.engine.shutdown()

    files = sorted(tmp_path.rglob("*.kv"))
    for f in files[::3]:
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0x5A
        f.write_bytes(bytes(raw))
    again = _llm(path, **tight, **offload)
    records = _offload_replay(again)
    assert [r["output"] for r in records] == [r["output"] for r in reference]
    again.engine.drain_kv_offload()
    stats = again.engine.offload.snapshot()
    assert stats["disk"].corrupt > 0 and stats["disk"].tokens_recomputed > 0
