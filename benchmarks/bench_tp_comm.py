"""Communication volume per token of tensor parallel, counted at the communicator.

Every TP group's communicator is a `CountingCommunicator` (tokenmill.distributed.
parallel_state); this script runs a tiny llama with tp = 2 and 4 through `LLM` (mp
executor, gloo on loopback) and reads each rank's counted payload bytes before and
after a prefill of P tokens and K decode steps of one sequence, then prints them beside
the formula:

    per token, all_reduce payload = (2 * layers + 1) * hidden * dtype_bytes
        (o_proj and down_proj per layer, plus the vocab-parallel embedding)
    per sampled token, all_gather result = tp * ceil(vocab / tp) * dtype_bytes

and the wire bytes a ring algorithm would send per rank for that payload:
2 (tp-1)/tp x all_reduce payload + (tp-1)/tp x all_gather result.

Usage: python benchmarks/bench_tp_comm.py [--prompt-tokens 32] [--decode-tokens 16]
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


def measure(path: Path, tp: int, dtype: str, prompt: list[int], decode: int) -> dict:
    llm = LLM(str(path), dtype=dtype, platform="cpu", tensor_parallel_size=tp,
              num_kv_blocks=64, enable_prefix_caching=False)
    try:
        rpc = llm.engine.executor.collective_rpc

        def counted() -> int:
            per_rank = rpc("communicated_bytes", ("tp",))
            assert len(set(per_rank)) == 1, per_rank  # every rank takes part in every call
            return per_rank[0]

        def run(max_tokens: int) -> tuple[int, float]:
            before = counted()
            start = time.perf_counter()
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
            return counted() - before, time.perf_counter() - start

        prefill, _ = run(1)
        both, seconds = run(1 + decode)
        hf = llm.engine.loaded.hf_config
        return {"prefill": prefill, "decode": (both - prefill) / decode, "hf": hf,
                "decode_s": seconds}
    finally:
        llm.engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=16)
    args = parser.parse_args()
    path = make_tiny_model(Path(tempfile.mkdtemp()) / "llama", "llama")
    prompt = list(range(5, 5 + args.prompt_tokens))
    print(f"P={args.prompt_tokens} prompt tokens, K={args.decode_tokens} decode tokens, batch 1")
    print("| tp | dtype | counted / decode token | formula | counted / prefill (P tokens) "
          "| formula | ring wire bytes / rank / decode token |")
    print("|---|---|---|---|---|---|---|")
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        for tp in (2, 4):
            got = measure(path, tp, dtype, prompt, args.decode_tokens)
            hf = got["hf"]
            reduce_bytes = (2 * hf.num_hidden_layers + 1) * hf.hidden_size * size
            gather_bytes = tp * -(-hf.vocab_size // tp) * size
            decode_formula = reduce_bytes + gather_bytes
            prefill_formula = args.prompt_tokens * reduce_bytes + gather_bytes
            wire = 2 * (tp - 1) / tp * reduce_bytes + (tp - 1) / tp * gather_bytes
            print(f"| {tp} | {dtype} | {got['decode']:.0f} | {decode_formula} | "
                  f"{got['prefill']} | {prefill_formula} | {wire:.0f} |")


if __name__ == "__main__":
    main()
