"""FP8 KV cache accuracy on the default model (docs/quantized-kv.md): perplexity over a
fixed sample of Python's own sources, and greedy agreement, with `kv_cache_dtype` auto
(bf16) against fp8 (e4m3) and fp8_e5m2, on one machine in one run.

The text: the stdlib files named in STDLIB_FILES (they ship with every CPython), read in
that order, tokenized, the first `--tokens` tokens (50,000 by default) cut into windows of
`--window` tokens; each window is one prompt with `prompt_logprobs=0`, so every token
after a window's first is scored given the window before it (prefill is chunked, so the
later chunks read the earlier ones' keys back from the cache: the quantized path). The
greedy agreement: `--greedy-prompts` windows' first 256 tokens, each continued
`--greedy-tokens` tokens greedily; the share of positions where the FP8 run's token equals
the bf16 run's (up to the first difference, and over all positions).

A `--kv-dtypes` entry `NAME-calibrated` (e.g. `fp8-calibrated`) runs `kv_cache_dtype`
NAME with `calculate_kv_scales=True` (per-head scales from a calibration prefill at
start, docs/quantized-kv.md); plain NAME keeps the checkpoint's scales, else 1.0.

    python benchmarks/bench_kv_quant_accuracy.py --kv-dtypes auto fp8 fp8-calibrated \
        --out benchmarks/results/kv-quant-accuracy.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sysconfig
import time
from pathlib import Path

STDLIB_FILES = (
    "argparse.py", "dataclasses.py", "difflib.py", "textwrap.py", "typing.py", "enum.py",
    "functools.py", "inspect.py", "pathlib.py", "shutil.py", "subprocess.py", "tarfile.py",
)


def sample_text() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / name).read_text(encoding="utf-8") for name in STDLIB_FILES
             if (root / name).is_file()]
    return "\n\n".join(parts)


def perplexity(llm, windows: list[list[int]]) -> tuple[float, int]:
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll, count = 0.0, 0
    for window, out in zip(windows, outs, strict=True):
        for token, position in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            nll -= position[token].logprob
            count += 1
    return math.exp(nll / count), count


def greedy(llm, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(len(r) for r in a)
    prefix = []
    for ra, rb in zip(a, b):
        n = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra))
        prefix.append(n)
    return {"positions_equal": same / total, "identical_sequences": sum(
        n == len(r) for n, r in zip(prefix, a)), "mean_tokens_before_first_difference":
        sum(prefix) / len(prefix)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=50_000)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--greedy-prompts", type=int, default=16)
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--kv-dtypes", nargs="+",
                        default=["auto", "fp8", "fp8-calibrated", "fp8_e5m2"],
                        help="kv_cache_dtype values, the first the baseline; NAME-calibrated: "
                        "NAME with calculate_kv_scales")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="the KV pool's bytes for every run (skips the start-up "
                        "profiling step, minutes on a loaded CPU); default: sized by the "
                        "engine")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from tokenmill import LLM

    results: dict = {"load_before": os.getloadavg(), "python": platform.python_version(),
                     "files": STDLIB_FILES, "window": args.window, "runs": {},
                     "kv_cache_memory_bytes": args.kv_cache_memory_bytes}
    greedy_out: dict[str, list[list[int]]] = {}
    windows = prompts = None
    for kv in args.kv_dtypes:
        kv_cache_dtype, calibrated = kv.removesuffix("-calibrated"), kv.endswith("-calibrated")
        llm = LLM(dtype=args.dtype, kv_cache_dtype=kv_cache_dtype,
                  calculate_kv_scales=calibrated, max_model_len=args.window + 128,
                  kv_cache_memory_bytes=args.kv_cache_memory_bytes)
        if windows is None:
            ids = llm.get_tokenizer().encode(sample_text())[: args.tokens]
            windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
            windows = [w for w in windows if len(w) > 1]
            prompts = [w[:256] for w in windows[: args.greedy_prompts]]
            results["tokens"] = len(ids)
        start = time.perf_counter()
        ppl, scored = perplexity(llm, windows)
        greedy_out[kv] = greedy(llm, prompts, args.greedy_tokens)
        results["runs"][kv] = {"perplexity": ppl, "scored_tokens": scored,
                               "kv_blocks": llm.engine.num_kv_blocks,
                               "seconds": time.perf_counter() - start}
        print(kv, results["runs"][kv], flush=True)
        llm.engine.shutdown()
        del llm
    base = args.kv_dtypes[0]
    for kv in args.kv_dtypes[1:]:
        run = results["runs"][kv]
        run["perplexity_ratio"] = run["perplexity"] / results["runs"][base]["perplexity"]
        run["greedy_vs_" + base] = agreement(greedy_out[base], greedy_out[kv])
        print(kv, "ratio", run["perplexity_ratio"], run["greedy_vs_" + base], flush=True)
    results["load_after"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
