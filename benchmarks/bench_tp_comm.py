"""Communication volume per token of every parallel mix, counted at the communicator.

Every group's communicator is a `CountingCommunicator` (tokenmill.distributed.
parallel_state) that adds up, per collective, the payload bytes each rank hands in
(all_gather: the gathered result). This script runs tiny models through `LLM` (mp
executor, gloo on loopback), reads every rank's counts of every group and collective
before and after a prefill of P tokens and K decode steps of one sequence, sums them
over the ranks and prints them beside the formula (`formula`, below), per decode token
and per prefill. Notation: L layers, H hidden, b dtype bytes, V vocab, k experts per
token, Hq query heads, D head size, KVh KV heads, T a step's tokens, t the TP size.

- tp: per rank (2L+1) T H b all_reduce (o_proj, down_proj, embedding) + t ceil(V/t) b
  all_gather per sampled row (logits), the same on each of the t ranks.
- tp + sp: the all_reduces become reduce_scatter + all_gather of T' = t ceil(T/t)
  rows each (plus the final hidden states' all_gather): 2 (2L+1) T' H b + logits.
- MoE tp (experts' intermediate split): as tp. ep (enable_expert_parallel): the MoE
  layers' all_reduce goes, (L+1) T H b stays per rank; per MoE layer, summed over the
  ranks, t^2 x 8 (row counts, all_to_all) + T k (2 H b + 8) (rows and their expert ids
  out, outputs back, all_to_all_single) + t^2 ceil(T/t) H b (all_gather of the slices).
- dcp n (x tp t): per rank and layer n T (Hq/t) (D+1) x 4 (float32 partial outputs and
  log-sum-exps, all_gather), besides tp's own.
- pcp n (x tp t): a step of T >= 2n tokens, per rank: L x 2 n ceil(T/n) (KVh/t) D b
  (keys and values, all_gather) + n ceil(T/n) H b (final hidden states); each pcp rank's
  tp group all-reduces its slice only (the slices add up to T). Decode steps run whole.

Usage: python benchmarks/bench_tp_comm.py [--prompt-tokens 32] [--decode-tokens 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_models import make_tiny_model  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_single")
DIMS = ("tp", "dcp", "pcp")
B = 4  # float32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def formula(mode: dict, hf, num_tokens: int, sampled: int) -> int:
    """Bytes summed over every rank for one step of `num_tokens` tokens."""
    t, n_dcp, n_pcp = mode.get("tensor_parallel_size", 1), mode.get(
        "decode_context_parallel_size", 1), mode.get("prefill_context_parallel_size", 1)
    world, layers, hidden, T = t * n_dcp * n_pcp, hf.num_hidden_layers, hf.hidden_size, num_tokens
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    head = getattr(hf, "head_dim", None) or hidden // heads
    logits = t * cdiv(hf.vocab_size, t) * B * sampled if t > 1 else 0
    total = 0
    if t > 1:
        if mode.get("enable_sequence_parallelism"):
            per_rank = 2 * (2 * layers + 1) * t * cdiv(T, t) * hidden * B
        elif mode.get("enable_expert_parallel"):
            per_rank = (layers + 1) * T * hidden * B
            k = hf.num_experts_per_tok
            total += layers * (t * t * 8 + T * k * (2 * hidden * B + 8) + t * t * cdiv(T, t) * hidden * B)
        else:
            per_rank = (2 * layers + 1) * T * hidden * B
        # a split prefill gives each pcp rank its slice: the tp groups' tokens add up to T
        split = n_pcp > 1 and T >= 2 * n_pcp
        total += (world // n_pcp if split else world) * per_rank + world * logits
    if n_dcp > 1:
        total += world * layers * n_dcp * T * (heads // t) * (head + 1) * 4
    if n_pcp > 1 and T >= 2 * n_pcp:
        rows = n_pcp * cdiv(T, n_pcp)
        total += world * (layers * 2 * rows * max(kv_heads // t, 1) * head * B + rows * hidden * B)
    return total


def measure(path: Path, mode: dict, prompt: list[int], decode: int) -> dict:
    llm = LLM(str(path), dtype="float32", platform="cpu", num_kv_blocks=64,
              enable_prefix_caching=False, **mode)
    try:
        rpc = llm.engine.executor.collective_rpc

        def counted() -> int:
            return sum(sum(rpc("communicated_op_bytes", (d, op))) for d in DIMS for op in OPS)

        def run(max_tokens: int) -> int:
            before = counted()
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
            return counted() - before

        start = time.perf_counter()
        prefill = run(1)
        both = run(1 + decode)
        return {"prefill": prefill, "decode": (both - prefill) / decode,
                "hf": llm.engine.loaded.hf_config, "s": time.perf_counter() - start}
    finally:
        llm.engine.shutdown()


MODES = [
    ("llama", "tp2", {"tensor_parallel_size": 2}),
    ("llama", "tp2 + sp", {"tensor_parallel_size": 2, "enable_sequence_parallelism": True}),
    ("mixtral", "tp2 (MoE)", {"tensor_parallel_size": 2}),
    ("mixtral", "ep2", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("mixtral", "tp4 x ep4", {"tensor_parallel_size": 4, "enable_expert_parallel": True}),
    ("llama", "dcp2", {"decode_context_parallel_size": 2}),
    ("llama", "tp2 x dcp2", {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}),
    ("llama", "pcp2", {"prefill_context_parallel_size": 2}),
    ("llama", "tp2 x pcp2", {"tensor_parallel_size": 2, "prefill_context_parallel_size": 2}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--only", nargs="*", default=None, help="mode names to run")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    paths = {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "mixtral")}
    prompt = list(range(5, 5 + args.prompt_tokens))
    P, K = args.prompt_tokens, args.decode_tokens
    print(f"P={P} prompt tokens, K={K} decode tokens, batch 1, float32; bytes summed over ranks")
    print("| model | mix | ranks | counted / decode token | formula | counted / prefill "
          f"({P} tokens) | formula |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for arch, name, mode in MODES:
        if args.only and name not in args.only:
            continue
        got = measure(paths[arch], mode, prompt, K)
        hf = got["hf"]
        ranks = 1
        for key in ("tensor_parallel_size", "decode_context_parallel_size",
                    "prefill_context_parallel_size"):
            ranks *= mode.get(key, 1)
        decode_f, prefill_f = formula(mode, hf, 1, 1), formula(mode, hf, P, 1)
        print(f"| {arch} | {name} | {ranks} | {got['decode']:.0f} | {decode_f} | "
              f"{got['prefill']} | {prefill_f} |", flush=True)


if __name__ == "__main__":
    main()
