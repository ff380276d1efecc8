"""Quantized weights (docs/quantization.md): accuracy and speed of the shipped Q4_1 GGUF
run as Q4_1 (`quantization="gguf"`) against the same file dequantized
(`quantization="none"`), and against llama.cpp on the same file and threads.

    python benchmarks/bench_quantization.py ppl [--tokens 50000] [--dtype bfloat16]
        [--gguf-dtype bfloat16] [--none-dtype float32]
    python benchmarks/bench_quantization.py ops [--dtype float32]
    python benchmarks/bench_quantization.py moe [--experts 128]
    python benchmarks/bench_quantization.py q4ops [--batches 1 4 8 16 32]
    python benchmarks/bench_quantization.py profile [--dtype auto] [--paths current|aten]
    python benchmarks/bench_quantization.py decode [--gguf-dtypes auto bfloat16] [--rounds 3]
        [--none-dtypes auto float32 bfloat16]
        [--llama-python ../peers/llamacpp/bin/python]

`ppl`: perplexity over a fixed sample of text that ships with Python (the stdlib's own
sources, `*.py` of the stdlib folder in sorted order, concatenated until `--tokens`
tokens), in windows of `--window` tokens scored with prompt logprobs, and the greedy
agreement (the share of positions whose argmax token is the same in both runs); each
path in `--dtype` unless `--gguf-dtype` / `--none-dtype` say otherwise (ATen's int4 kernel
is fast only with bf16 activations on a CPU without AVX-512: `ops --dtype float32`),
the none path first, each path's figures printed to stderr when it finishes.
`ops`: one matmul of each of SmolLM2's shapes at batch 1 and 64, dense in `--dtype` (the
cpu plugin's prepack_linear) against the int4 kernel with activations in `--dtype`.
`decode`: output tokens/s at batch 1 (tokenmill gguf, tokenmill none, llama.cpp) and at
batch 64 (tokenmill gguf, none), the gguf path once per `--gguf-dtypes`, the none path
once per `--none-dtypes` (each row is named with the dtype the engine resolved: on a CPU without native bf16 the cpu
plugin's 'auto' is float32). llama.cpp is llama-cpp-python in the venv that
`benchmarks/serving/prepare_peers.sh llamacpp` makes; a missing one is said, not skipped
silently.
`u8ops`: the 6/8-bit kernel (the cpu plugin's quantized_linear_u8) on Q8_0- and
Q6_K-shaped weights of SmolLM2-135M's shapes (576x576, 1536x576, 576x1536, the 49152x576
embedding / lm-head) at batch 1 and 16, float32 activations, against dense float32
F.linear on the dequantized weight and against the core's reference (dequantizes per call).
`q4ops`: the plugin's 4-bit kernel (quantized_linear_q4, float32 and bf16 activations)
at SmolLM2's four projection shapes (Q4_1 codes, group 32) against ATen's int4 kernel
with bf16 and float32 activations, dense float32 / bf16 (the plugin's prepack_linear),
and the weight dequantized per call then multiplied in float32 (the core's reference).
`moe`: one MoE layer of Qwen3-30B-A3B's expert shapes (hidden 2048, experts of 768, top
8 of `--experts`), its experts as int4 codes in groups of 32 (`QuantizedExperts`, the
cpu int4 kernel per expert) against the same weights dense in bf16 (the platform's op
`moe_experts`), at batch 1 and 16.
`profile`: where a batch-1 decode step of `quantization="gguf"` spends its time (the LM
head, each projection's quantized linear, the attention backend, the rest of the
forward, outside the forward), each callable timed with perf_counter; `--paths aten`
runs the paths before the plugin's own 4-bit kernel (ATen's int4 kernel, a dense head).
Everything of one mode runs in one process, one after another: compare the ratios, and
note the machine's load (`uptime`), which the script prints.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def stdlib_sample(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the stdlib's `*.py` files, sorted by name."""
    ids: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids.extend(tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False))
        if len(ids) >= num_tokens:
            break
    return ids[:num_tokens]


def score(llm, windows: list[list[int]]) -> tuple[float, list[int]]:
    """(sum of -logprob over every predicted position, the argmax token at each one)."""
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    prompts = [{"prompt_token_ids": w} for w in windows]
    nll, argmax = 0.0, []
    for window, out in zip(windows, llm.generate(prompts, params, use_tqdm=False)):
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            nll -= entry[window[pos]].logprob
            argmax.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return nll, argmax


def run_ppl(args) -> dict:
    from tokenmill import LLM

    results, argmaxes = {}, {}
    dtypes = {"gguf": args.gguf_dtype or args.dtype, "none": args.none_dtype or args.dtype}
    for method in ("none", "gguf"):
        llm = LLM(quantization=method, dtype=dtypes[method], max_num_batched_tokens=args.window,
                  enable_prefix_caching=False)
        ids = stdlib_sample(llm.get_tokenizer(), args.tokens)
        windows = [ids[i:i + args.window] for i in range(0, len(ids), args.window)]
        start = time.perf_counter()
        nll, argmaxes[method] = score(llm, windows)
        n = len(argmaxes[method])
        results[method] = {"ppl": math.exp(nll / n), "positions": n,
                           "seconds": time.perf_counter() - start,
                           "dtype": str(llm.engine.dtype).removeprefix("torch.")}
        print(f"{method}: {results[method]}", file=sys.stderr, flush=True)
        llm.engine.shutdown()
        del llm
    same = sum(a == b for a, b in zip(argmaxes["gguf"], argmaxes["none"]))
    results["ppl_ratio"] = results["gguf"]["ppl"] / results["none"]["ppl"]
    results["argmax_agreement"] = same / len(argmaxes["none"])
    return results


def _bench(fn, x, reps: int) -> float:
    for _ in range(3):
        fn(x)
    start = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - start) / reps


def run_ops(args) -> dict:
    import torch

    from tokenmill.platforms.ops import quant
    from tokenmill_cpu import ops

    if args.dtype not in ("float32", "bfloat16"):
        raise SystemExit(f"ops --dtype {args.dtype!r}: use float32 or bfloat16")
    dtype = getattr(torch, args.dtype)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    g = torch.Generator().manual_seed(0)
    rows = {}
    for name, (n, k) in shapes.items():
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scales = torch.rand(n, k // 32, generator=g) * 0.01
        weight = quant.QuantizedWeight(quant.QuantScheme("gguf", "Q4_1", 4, 32),
                                       quant.pack_int4(codes), scales, -8 * scales, k, n)
        dense = ops.prepack_linear(quant.dequantize(weight, dtype), None)
        int4 = ops.prepack_quantized_linear(weight, None)
        for m in (1, 64):
            x = torch.randn(m, k, generator=g).to(dtype)
            reps = 200 if m == 1 else 20
            t_dense, t_int4 = _bench(dense, x, reps), _bench(int4, x, reps)
            rows[f"{name} {n}x{k} batch {m}"] = {
                "dtype": args.dtype, "dense_us": t_dense * 1e6, "int4_us": t_int4 * 1e6,
                "speedup": t_dense / t_int4}
    return rows


def run_u8ops(args) -> dict:
    import torch
    import torch.nn.functional as F

    from tokenmill.platforms.ops import quant
    from tokenmill_cpu import ops

    shapes = {"o": (576, 576), "gate/up": (1536, 576), "down": (576, 1536),
              "embed/lm_head": (49152, 576)}
    schemes = {"Q8_0": quant.QuantScheme("gguf", "Q8_0", 8, 32),
               "Q6_K": quant.QuantScheme("gguf", "Q6_K", 6, 16)}
    g = torch.Generator().manual_seed(0)
    rows = {}
    for fmt, scheme in schemes.items():
        for name, (n, k) in shapes.items():
            g_ = scheme.group_size
            codes = torch.randint(0, 1 << scheme.bits, (n, k), generator=g, dtype=torch.uint8)
            scales = torch.rand(n, k // g_, generator=g) * 0.01
            weight = quant.QuantizedWeight(scheme, codes, scales, -(1 << (scheme.bits - 1)) * scales,
                                           k, n)
            dense_w = quant.dequantize(weight, torch.float32)
            kernel = ops.prepack_quantized_linear(weight, None)
            if not isinstance(kernel, ops.Uint8QuantizedLinear):
                raise SystemExit(f"{fmt} {n}x{k}: the cpu kernel did not take it ({kernel})")
            reference = quant.prepack_quantized_linear(weight, None)
            for m in args.batches:
                x = torch.randn(m, k, generator=g)
                reps = max(3, int(2e8 / (n * k * (m if m > 1 else 4))))
                row = {"dense_f32_us": _bench(functools.partial(F.linear, weight=dense_w), x, reps),
                       "kernel_us": _bench(kernel, x, reps),
                       "kernel_bf16_us": _bench(kernel, x.bfloat16(), reps),
                       # what the layer does past DEQUANTIZE_ROWS: dequantize_u8_into + GEMM
                       "dequant_dense_f32_us": _bench(kernel.dequantized, x, reps),
                       "dequant_dense_bf16_us": _bench(kernel.dequantized, x.bfloat16(), reps)}
                if m <= 16:  # the reference dequantizes in torch on every call: slow
                    row["reference_us"] = _bench(reference, x, max(3, reps // 20))
                row = {key: t * 1e6 for key, t in row.items()}
                row["kernel_vs_dense"] = row["dense_f32_us"] / row["kernel_us"]
                rows[f"{fmt} {name} {n}x{k} batch {m}"] = row
                print(f"{fmt} {name} {n}x{k} batch {m}: " + ", ".join(
                    f"{key} {v:.0f}" for key, v in row.items() if key.endswith("_us")), file=sys.stderr)
    return rows


def run_q4ops(args) -> dict:
    """The plugin's 4-bit kernel at SmolLM2's shapes and small batches against ATen's int4
    kernel (bf16 activations), dense float32 and dense bf16 (the plugin's prepack_linear)."""
    import torch

    from tokenmill.platforms.ops import quant
    from tokenmill_cpu import ops

    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    g = torch.Generator().manual_seed(0)
    rows = {}
    for name, (n, k) in shapes.items():
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scales = torch.rand(n, k // 32, generator=g) * 0.01
        weight = quant.QuantizedWeight(quant.QuantScheme("gguf", "Q4_1", 4, 32),
                                       quant.pack_int4(codes), scales, -8 * scales, k, n)
        paths = {
            "dense_f32": (ops.prepack_linear(quant.dequantize(weight), None), torch.float32),
            "dense_bf16": (ops.prepack_linear(quant.dequantize(weight, torch.bfloat16), None),
                           torch.bfloat16),
            "aten_int4_bf16": (ops.Int4PackedLinear(weight, None), torch.bfloat16),
            "aten_int4_f32": (ops.Int4PackedLinear(weight, None), torch.float32),
            # what Int4QuantizedLinear does with float32 past KERNEL_ROWS
            "dequantized_f32": (functools.partial(quant.quantized_linear, weight=weight,
                                                  bias=None), torch.float32),
        }
        kernel = ops.prepack_quantized_linear(weight, None)
        if not isinstance(kernel, ops.Int4QuantizedLinear):
            raise SystemExit(f"{name}: the plugin's 4-bit kernel did not take it ({kernel})")
        kernel.KERNEL_ROWS = max(args.batches)  # this instance only: the kernel at every batch
        paths["q4_kernel_f32"] = (kernel, torch.float32)
        paths["q4_kernel_bf16"] = (kernel, torch.bfloat16)
        # dequantized for the call by the kernels' dequantize_q4_into, then one dense GEMM
        paths["dequant_dense_f32"] = (kernel.dequantized, torch.float32)
        paths["dequant_dense_bf16"] = (kernel.dequantized, torch.bfloat16)
        for m in args.batches:
            x = torch.randn(m, k, generator=g)
            reps = max(5, int(4e7 / (n * k * max(m, 4))))
            row = {f"{p}_us": _bench(fn, x.to(dtype), reps) * 1e6
                   for p, (fn, dtype) in paths.items()}
            rows[f"{name} {n}x{k} batch {m}"] = row
            print(f"{name} {n}x{k} batch {m}: " + ", ".join(f"{p} {v:.0f}" for p, v in row.items()),
                  file=sys.stderr)
    return rows


def run_moe(args) -> dict:
    import torch

    from tokenmill.model.linear import DenseWeights, LayerBuilder
    from tokenmill.model.moe import FusedMoE
    from tokenmill.model.quant import QuantizedExperts
    from tokenmill.platforms.ops import quant
    from tokenmill.platforms.registry import load_platform

    hidden, inter, experts, top_k = 2048, 768, args.experts, 8
    ops = load_platform("cpu").ops
    scheme = quant.QuantScheme("gguf", "Q4_0", 4, 32)
    g = torch.Generator().manual_seed(0)

    def layer(weights) -> FusedMoE:
        dense = DenseWeights(torch.bfloat16)  # the router
        build = LayerBuilder(ops=ops, dtype=torch.bfloat16,
                             schemes=lambda prefix: weights if prefix == "mlp" else dense)
        return FusedMoE(hidden_size=hidden, intermediate_size=inter, num_experts=experts,
                        top_k=top_k, routing="softmax_topk", renormalize=True,
                        activation="silu", router_bias=False, expert_bias=False,
                        build=build, prefix="mlp")

    quantized = layer(QuantizedExperts(scheme, scheme, torch.bfloat16))
    dense = layer(DenseWeights(torch.bfloat16))
    router = torch.randn(experts, hidden, generator=g) * 0.02
    for name, (out, n) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
        codes = torch.randint(0, 16, (experts, out, n), generator=g, dtype=torch.uint8)
        scales = torch.rand(experts, out, n // 32, generator=g) * 0.01
        getattr(quantized, f"{name}_codes").data.copy_(quant.pack_int4(codes))
        getattr(quantized, f"{name}_scales").data.copy_(scales)
        getattr(quantized, f"{name}_offsets").data.copy_(-8 * scales)
        getattr(dense, name).data.copy_(((codes.float() - 8) * scales.repeat_interleave(
            32, -1)).bfloat16())
    rows = {}
    for moe in (quantized, dense):
        moe.router.weight.data.copy_(router.bfloat16())
        moe.prepack(ops)
        moe.router.prepack(ops)
    for m in (1, 16):
        x = torch.randn(m, hidden, generator=g).bfloat16()
        reps = 50 if m == 1 else 10
        with torch.inference_mode():
            t_dense, t_int4 = _bench(dense, x, reps), _bench(quantized, x, reps)
        rows[f"batch {m}"] = {"bf16_ms": t_dense * 1e3, "int4_ms": t_int4 * 1e3,
                              "speedup": t_dense / t_int4}
    rows["expert_bytes"] = {
        "bf16": sum(p.numel() * p.element_size() for n, p in dense.named_parameters()
                    if n.startswith("w")),
        "int4": sum(p.numel() * p.element_size() for n, p in quantized.named_parameters()
                    if n.startswith("w"))}
    return rows


class _DecodeEngine:
    """One engine (method, dtype) and its `batch` prompts; `rate(new_tokens)`: output
    tokens/s of decode, (time for new_tokens) - (time for 1)."""

    def __init__(self, method: str, dtype: str, batch: int) -> None:
        from tokenmill import LLM

        # a small arena: several engines are held at once, measured in turn
        self.llm = LLM(quantization=method, dtype=dtype, enable_prefix_caching=False,
                       num_kv_blocks=1024)
        self.resolved = str(self.llm.engine.dtype).removeprefix("torch.")
        self.batch = batch
        self.prompts = [f"Write a short story about robot number {i}." for i in range(batch)]
        self._timed(2)  # warm-up

    def _timed(self, n: int) -> float:
        from tokenmill import SamplingParams

        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        self.llm.generate(self.prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    def rate(self, new_tokens: int) -> float:
        return self.batch * (new_tokens - 1) / (self._timed(new_tokens) - self._timed(1))


LLAMA_CODE = """
import sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]), verbose=False)
prompt = "Write a short story about robot number 0."
def timed(n):
    start = time.perf_counter()
    out = llm.create_completion(prompt, max_tokens=n, temperature=0, seed=0,
                                logit_bias={llm.token_eos(): -1e9})  # no early stop
    assert out["usage"]["completion_tokens"] == n, out["usage"]
    return time.perf_counter() - start
timed(2)
n = int(sys.argv[3])
print((n - 1) / (timed(n) - timed(1)))
"""


def run_decode(args) -> dict:
    import torch

    from tokenmill.model.loader import default_model_path

    threads = torch.get_num_threads()
    rates = {}

    def tokenmill_rows(batch: int) -> None:
        # every configuration loaded, then measured in turn `--rounds` times: the median
        # of each, and its samples (this machine's speed drifts by 2x within minutes)
        configs = [("gguf", d) for d in args.gguf_dtypes] + [("none", d) for d in args.none_dtypes]
        engines = [_DecodeEngine(method, wanted, batch) for method, wanted in configs]
        samples = [[] for _ in engines]
        for _ in range(args.rounds):
            for engine, got in zip(engines, samples):
                got.append(engine.rate(args.new_tokens))
        for (method, wanted), engine, got in zip(configs, engines, samples):
            label = (f"tokenmill gguf ({engine.resolved} activations, asked {wanted})"
                     if method == "gguf" else f"tokenmill none ({engine.resolved}, asked {wanted})")
            rates[f"{label} batch {batch}"] = statistics.median(got)
            rates[f"{label} batch {batch} samples"] = got
            engine.llm.engine.shutdown()

    tokenmill_rows(1)
    if Path(args.llama_python).exists():
        out = subprocess.run([args.llama_python, "-c", LLAMA_CODE, default_model_path(),
                              str(threads), str(args.new_tokens)], capture_output=True, text=True)
        if out.returncode == 0:
            rates["llama.cpp batch 1"] = float(out.stdout.strip().splitlines()[-1])
        else:
            print(f"llama.cpp failed: {out.stderr[-2000:]}", file=sys.stderr)
    else:
        print(f"llama.cpp row left out: {args.llama_python} missing "
              "(benchmarks/serving/prepare_peers.sh llamacpp)", file=sys.stderr)
    tokenmill_rows(64)
    rates["threads"] = threads
    return rates


class _Clock:
    """Seconds spent in each wrapped callable, by category (the profile's instrument:
    perf_counter around each call, about 1 us of overhead a call)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        taken = (self.seconds, self.calls)
        self.seconds, self.calls = {}, {}
        return taken


class _TimedBackend:
    """An attention backend whose `forward` is timed; everything else is the backend's."""

    def __init__(self, backend, clock: _Clock) -> None:
        self._backend = backend
        self.forward = clock.wrap("attention (the backend's forward)", backend.forward)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def run_profile(args) -> dict:
    """Where one batch-1 decode step's time goes: the LM head, the quantized linears by
    projection, the attention backend, the rest of the model's forward (norms, rotary,
    activation, embedding, residuals) and what is outside the forward (scheduler,
    sampling, detokenizing, Python). Per token: (instrumented time over `--new-tokens`
    tokens) - (over 1 token), divided by new_tokens - 1, as `decode` measures."""
    import torch

    from tokenmill import LLM, SamplingParams
    from tokenmill.model.layers import Attention
    from tokenmill.model.linear import Linear
    from tokenmill_cpu import ops as cpu_ops

    llm = LLM(quantization="gguf", dtype=args.dtype, enable_prefix_caching=False)
    model = llm.engine.executor.worker.runner.model
    resolved = str(llm.engine.dtype).removeprefix("torch.")
    clock = _Clock()
    if args.paths == "aten":  # the paths before the plugin's 4-bit kernel and quantized head
        cpu_ops.Int4QuantizedLinear.KERNEL_ROWS = 0
        model._logits_fn = model.ops.prepack_linear(model.model.embed_tokens.weight, None)
    kernels = set()
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module._apply_packed is not None:
            kind = name.rpartition(".")[2]
            kernel = getattr(module._apply_packed, "kernel", "dense")
            if args.paths == "aten" and isinstance(module._apply_packed, cpu_ops.Int4QuantizedLinear):
                kernel = cpu_ops.Int4PackedLinear.kernel  # bf16; float32 goes dequantized
            kernels.add(f"{kind}: {kernel}")
            module._apply_packed = clock.wrap(f"linear {kind}", module._apply_packed)
        if isinstance(module, Attention):
            module.backend = _TimedBackend(module.backend, clock)
    kernels.add(f"head: {getattr(model._logits_fn, 'kernel', 'dense')}")
    model._logits_fn = clock.wrap("lm head", model._logits_fn)
    model.forward = clock.wrap("model forward", model.forward)
    prompt = ["Write a short story about robot number 0."]

    def timed(n: int) -> tuple[float, dict[str, float], dict[str, int]]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        clock.take()
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return (time.perf_counter() - start, *clock.take())

    timed(2)  # warm-up
    wall_n, secs_n, calls_n = timed(args.new_tokens)
    wall_1, secs_1, calls_1 = timed(1)
    steps = args.new_tokens - 1
    per = {k: (secs_n[k] - secs_1.get(k, 0.0)) / steps * 1e3 for k in secs_n}
    calls = {k: (calls_n[k] - calls_1.get(k, 0)) / steps for k in calls_n}
    step_ms = (wall_n - wall_1) / steps * 1e3
    inside = sum(v for k, v in per.items() if k not in ("model forward", "lm head"))
    split = {k: {"ms": round(v, 3), "calls": calls[k]} for k, v in sorted(per.items())
             if k != "model forward"}
    split["rest of the forward (norms, rotary, activation, residuals)"] = {
        "ms": round(per["model forward"] - inside, 3)}
    split["outside the forward (scheduler, sampling, Python)"] = {
        "ms": round(step_ms - per["model forward"] - per.get("lm head", 0.0), 3)}
    llm.engine.shutdown()
    return {"dtype": resolved, "paths": args.paths, "threads": torch.get_num_threads(),
            "kernels": sorted(kernels), "ms_per_token": round(step_ms, 3),
            "tokens_per_s": round(1e3 / step_ms, 1), "split": split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["ppl", "ops", "u8ops", "q4ops", "decode", "moe", "profile"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32],
                        help="q4ops, u8ops: the batch sizes")
    parser.add_argument("--rounds", type=int, default=1,
                        help="decode: each configuration measured this many times in turn "
                             "(the median is reported)")
    parser.add_argument("--paths", choices=["current", "aten"], default="current",
                        help="profile: 'aten' puts the 4-bit layers on ATen's int4 kernel "
                        "and the tied head dense (the paths before the plugin's kernel)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=50_000)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--gguf-dtype", choices=["auto", "float32", "bfloat16"],
                        help="ppl: the gguf path's dtype (default: --dtype)")
    parser.add_argument("--none-dtype", choices=["auto", "float32", "bfloat16"],
                        help="ppl: the none path's dtype (default: --dtype)")
    parser.add_argument("--gguf-dtypes", nargs="+", default=["auto"],
                        choices=["auto", "float32", "bfloat16"],
                        help="decode: the dtypes the gguf path runs in, a row each")
    parser.add_argument("--none-dtypes", nargs="+", default=["auto"],
                        choices=["auto", "float32", "bfloat16"],
                        help="decode: the dtypes the none (dequantized) path runs in, a row each")
    parser.add_argument("--llama-python", default=str(
        Path(os.environ.get("PEERS_DIR", Path(__file__).resolve().parents[2] / "peers"))
        / "llamacpp" / "bin" / "python"))
    args = parser.parse_args()
    os.environ.setdefault("TOKENMILL_LOG_LEVEL", "WARNING")
    before = _uptime()
    result = {"ppl": run_ppl, "ops": run_ops, "u8ops": run_u8ops, "q4ops": run_q4ops, "decode": run_decode,
              "moe": run_moe, "profile": run_profile}[args.mode](args)
    print(json.dumps({"mode": args.mode, "uptime_before": before, "uptime_after": _uptime(),
                      "result": result}, indent=2))


if __name__ == "__main__":
    main()
