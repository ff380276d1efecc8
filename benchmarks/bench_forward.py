"""Time one decode step of the default model (SmolLM2-135M) on CPU, bf16 vs fp32.

    python benchmarks/bench_forward.py [--batch 1 64] [--context 256] [--steps 20]

Each of `batch` sequences holds `context` cached tokens and decodes one more; the time is the
model forward plus logits of the step (median over `steps`), excluding metadata building.
Runs on the active platform (the CPU plugin here) as the engine does: its ops, its attention
backend, prepacked weights.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from model_harness import Sequence, build_metadata  # noqa: E402

from tokenmill.model.base import CausalLM  # noqa: E402
from tokenmill.model.loader import default_model_path, load_model_and_tokenizer  # noqa: E402
from tokenmill.platforms.registry import load_platform  # noqa: E402

BLOCK_SIZE = 16


@torch.inference_mode()
def time_decode(model: CausalLM, backend, batch: int, context: int, steps: int) -> float:
    """Median milliseconds of one decode step of `batch` sequences at `context` cached tokens."""
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    kv_caches = [
        torch.randn(2, num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_size).to(s.dtype)
        for s in model.attention_specs
    ]
    seqs = [
        Sequence(
            token_ids=[0] * (context + 1),
            block_ids=list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)),
            num_computed=context,
        )
        for i in range(batch)
    ]
    metadata = build_metadata([(s, 1) for s in seqs], BLOCK_SIZE)
    input_ids = torch.randint(0, model.hf_config.vocab_size, (batch,))
    positions = torch.full((batch,), context, dtype=torch.int64)
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        backend.prepare(metadata)
        hidden = model(input_ids, positions, kv_caches, metadata)
        model.compute_logits(hidden)
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    platform = load_platform()
    ops = platform.ops
    fp32 = load_model_and_tokenizer(
        default_model_path(), torch.float32, "cpu", ops, platform.attention_backend, BLOCK_SIZE
    ).model
    # bf16 copy of the same weights, without reading the GGUF twice
    bf16 = type(fp32)(
        fp32.hf_config,
        ops=ops,
        attention_backend=platform.attention_backend,
        dtype=torch.bfloat16,
        block_size=BLOCK_SIZE,
    )
    bf16.load_state_dict(fp32.state_dict())
    bf16.prepack()
    backend = bf16.attention_backends[0]
    print(
        f"SmolLM2-135M decode step, context {args.context}, backend {backend.name}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'batch':>6} {'fp32 ms':>9} {'bf16 ms':>9}")
    for batch in args.batch:
        ms = [time_decode(m, backend, batch, args.context, args.steps) for m in (fp32, bf16)]
        print(f"{batch:>6} {ms[0]:>9.1f} {ms[1]:>9.1f}")


if __name__ == "__main__":
    main()
