"""KV bytes one request holds at long context: sliding-window models vs the same model with
every layer on full attention; MLA vs the equivalent multi-head cache.

    python benchmarks/bench_kv_bytes.py [--contexts 4096 32768 131072] [--engine] [--mla]

`--mla` adds the bytes per token of DeepSeek-V3's and Kimi Linear's MLA layers (the
arena's page for their AttentionSpec, core/kv/arena.py) against the multi-head cache
the same layers would need with their keys and values decompressed (per head: a key of
qk_nope + qk_rope values and a value of v_head_dim values, as transformers' cache holds
them after expand_kv).

Part 1 runs the real KV manager (core/kv: groups, the sliding-window allocator, the shared
pool) on the layer layouts of Gemma 3 27B and gpt-oss-120b (bf16, blocks of 16): a request
is prefilled in 2048-token chunks, as the scheduler would, then decodes one token; the
table gives the most bytes it held at once and what it holds while decoding. Bytes are
blocks x (layers per group) x one layer's page. Part 2 (`--engine`) runs a tiny random
Gemma 3 through the engine on the CPU plugin and reads the same numbers from its KV
manager, to show the engine holds what part 1 counts.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch
from transformers import Gemma3TextConfig, GptOssConfig

from tokenmill.engine.request import Request
from tokenmill.kv.arena import KVArena
from tokenmill.kv.groups import plan_groups
from tokenmill.kv.manager import KVCacheManager
from tokenmill.model.base import attention_specs
from tokenmill.sampling_params import SamplingParams

BLOCK = 16
CHUNK = 2048
GIB = 1 << 30


def _configs() -> dict[str, object]:
    gemma = Gemma3TextConfig(  # Gemma 3 27B: 62 layers, 5 local (window 1024) : 1 global
        hidden_size=5376, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
        head_dim=128, sliding_window=1024, max_position_embeddings=131072,
    )
    gpt_oss = GptOssConfig()  # gpt-oss-120b's attention: 36 layers, window 128 every other
    gpt_oss.num_hidden_layers = 36
    gpt_oss.layer_types = ["sliding_attention", "full_attention"] * 18
    return {"Gemma 3 27B": gemma, "gpt-oss-120b": gpt_oss}


def _all_full(config):
    full = copy.deepcopy(config)
    full.layer_types = ["full_attention"] * config.num_hidden_layers
    return full


def request_bytes(config, context: int) -> tuple[int, int, int]:
    """(peak bytes, bytes while decoding, number of KV groups) of one request of
    `context` tokens, from the KV manager's own accounting."""
    specs = attention_specs(config, torch.bfloat16, BLOCK)
    layout = plan_groups(specs)
    block_bytes = layout.num_slots * KVArena.page_bytes_for(specs[0])
    kv = KVCacheManager(4 * (context // BLOCK + 2) * len(layout.groups), BLOCK, True, layout.groups)
    request = Request("r", list(range(context)), SamplingParams(max_tokens=1))
    peak = 0
    while request.num_computed_tokens < context:
        n = min(CHUNK, context - request.num_computed_tokens)
        assert kv.allocate_slots(request, n)
        request.num_computed_tokens += n
        peak = max(peak, sum(kv.num_blocks_held(request)))
    request.append_output_token(0)
    assert kv.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    decoding = sum(kv.num_blocks_held(request))
    return peak * block_bytes, decoding * block_bytes, len(layout.groups)


def allocator_table(contexts: list[int]) -> None:
    print("| model | context | groups | full attention: bytes | sliding: peak | sliding: decoding | decoding / full |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, config in _configs().items():
        for context in contexts:
            full, _, _ = request_bytes(_all_full(config), context)
            peak, decoding, groups = request_bytes(config, context)
            print(
                f"| {name} | {context:,} | {groups} | {full / GIB:.2f} GiB | {peak / GIB:.2f} GiB "
                f"| {decoding / GIB:.2f} GiB | {decoding / full:.3f} |"
            )


def engine_table(contexts: list[int]) -> None:
    """A tiny random Gemma 3 (window 64, 5 local : 1 global) through the engine."""
    from transformers import AutoModelForCausalLM

    from tokenmill import LLM
    from tokenmill_conformance.tiny_models import make_tokenizer

    tokenizer = make_tokenizer(300)
    print("| engine, tiny Gemma 3 | context | blocks held (full groups / window groups) | KV bytes | same model, all full |")
    print("|---|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for variant in ("sliding", "full"):
            config = Gemma3TextConfig(
                vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                sliding_window=64, max_position_embeddings=8192,
            )
            if variant == "full":
                config.layer_types = ["full_attention"] * 6
            path = Path(tmp) / variant
            AutoModelForCausalLM.from_config(config).save_pretrained(path)
            tokenizer.save_pretrained(path)
            llm = LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=512)
            engine = llm.engine
            model = engine.executor.worker.runner.model
            specs, layout = model.attention_specs, model.kv_layout
            block_bytes = layout.num_slots * KVArena.page_bytes_for(specs[0])
            for context in contexts:
                rid = f"{variant}{context}"
                engine.add_request(rid, [5] * context, SamplingParams(max_tokens=3, ignore_eos=True))
                request = engine.scheduler.requests[rid]
                held = None
                while not request.is_finished:
                    engine.step()
                    if not request.is_finished and request.num_computed_tokens >= context:
                        held = engine.kv.num_blocks_held(request)
                windows = [g.sliding_window for g in engine.kv.groups]
                full_blocks = sum(h for h, w in zip(held, windows) if w is None)
                window_blocks = sum(h for h, w in zip(held, windows) if w is not None)
                results[(variant, context)] = (full_blocks, window_blocks, sum(held) * block_bytes)
        for context in contexts:
            f, w, b = results[("sliding", context)]
            print(
                f"| decoding | {context:,} | {f} / {w} | {b / 1024:.0f} KiB "
                f"| {results[('full', context)][2] / 1024:.0f} KiB |"
            )


def mla_table(contexts: list[int]) -> None:
    from transformers import DeepseekV3Config, KimiLinearConfig

    from tokenmill.model.mla import mla_spec
    from tokenmill.model.registry import attention_specs_for

    kimi = KimiLinearConfig()  # Kimi-Linear-48B-A3B sizes; its default layer_types: 6 MLA of 27
    kimi_mla = [mla_spec(kimi, torch.bfloat16, BLOCK, 1.0)] * kimi.layer_types.count(
        "full_attention"
    )
    print("| model | MLA layers | MLA bytes / token | equivalent MHA bytes / token | ratio "
          "| MLA at " + " | MLA at ".join(f"{c:,}" for c in contexts) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(contexts))
    deepseek = attention_specs_for(DeepseekV3Config(), torch.bfloat16, BLOCK)
    for name, specs in (("DeepSeek-V3", deepseek), ("Kimi Linear 48B", kimi_mla)):
        mla = sum(KVArena.page_bytes_for(s) for s in specs) // BLOCK
        dims, heads = specs[0].mla, specs[0].num_heads
        mha = len(specs) * heads * (dims.qk_head_dim + dims.v_head_dim) * 2
        at = " | ".join(f"{mla * c / GIB:.2f} GiB" for c in contexts)
        print(f"| {name} | {len(specs)} | {mla:,} | {mha:,} | {mha / mla:.1f}x | {at} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--engine", action="store_true", help="also run the tiny engine check")
    parser.add_argument("--engine-contexts", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--mla", action="store_true", help="also print MLA vs MHA bytes")
    args = parser.parse_args()
    allocator_table(args.contexts)
    if args.mla:
        print()
        mla_table(args.contexts)
    if args.engine:
        print()
        engine_table(args.engine_contexts)


if __name__ == "__main__":
    sys.exit(main())
