"""Roofline benchmark of a random-weight Llama-3-8B-shaped model on the nvidia plugin.

Usage: python plugins/nvidia/hardware/bench_llama.py --out docs/hardware-results.md
           [--certificate cert.json] [--kernels kernels.md] [--workdir DIR] [--dry-run]
           [--results llama.json] [--render-only]

Builds the model from its config (hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP
14336, vocab 128256) with random bf16 weights and a word-level tokenizer of the same
vocabulary, saves it, and runs it through `tokenmill.LLM` on the nvidia platform:
- decode at batch 1 and 64 (128-token prompts): step time from two runs that differ only
  in the number of generated tokens, so prefill cancels out; roofline = (weights + KV read
  per step) / HBM bandwidth of the plugin's hardware spec;
- a 4096-token prefill in one step: FLOPs (2 x matmul params x tokens + causal attention) /
  time, against the datasheet bf16 peak and the peak measured by a large torch matmul.
Writes a Markdown report with date, versions and the fractions. `--dry-run` does the same
on a tiny model and tiny lengths (in Triton's interpreter on a machine without a GPU), to
check the script, not the hardware.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)


@dataclass(frozen=True, slots=True)
class Plan:
    prompt_len: int
    decode_tokens: int
    big_batch: int
    prefill_len: int
    matmul_n: int
    repeats: int  # timings are the minimum over this many runs


FULL = Plan(prompt_len=128, decode_tokens=128, big_batch=64, prefill_len=4096, matmul_n=8192,
            repeats=2)
DRY = Plan(prompt_len=12, decode_tokens=2, big_batch=4, prefill_len=24, matmul_n=64, repeats=1)


def build_model(path: Path, shape: dict, device: str) -> Path:
    """Save a random bf16 Llama of `shape` and a word-level tokenizer of its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    if (path / "config.json").exists():
        return path
    config = LlamaConfig(**shape, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=1, pad_token_id=0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
    model.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine loads its own copy
    vocab = {f"<t{i}>": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<t1>", pad_token="<t0>",
                            bos_token=None).save_pretrained(path)
    return path


def params(shape: dict) -> tuple[float, float]:
    """(matmul parameters per token of the transformer layers, lm_head parameters)."""
    h, i, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_key_value_heads"]
    head = h // shape["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv * head + 3 * h * i
    return per_layer * shape["num_hidden_layers"], h * shape["vocab_size"]


def timed_generate(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from tokenmill import SamplingParams

    params_ = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params_, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return elapsed


def decode_step_s(llm, batch: int, plan: Plan, vocab: int) -> float:
    prompts = [[(7 * b + 13 * j) % (vocab - 2) + 2 for j in range(plan.prompt_len)]
               for b in range(batch)]
    timed_generate(llm, prompts, 2)  # warm-up: Triton compiles this batch's kernels
    short = min(timed_generate(llm, prompts, 1) for _ in range(plan.repeats))
    long = min(timed_generate(llm, prompts, plan.decode_tokens + 1) for _ in range(plan.repeats))
    return (long - short) / plan.decode_tokens


def measured_peak(n: int, device: torch.device) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * n**3 / best


def run(args: argparse.Namespace) -> dict:
    """Build the model, measure, and return what was measured (plain JSON-able data)."""
    from tokenmill import LLM

    plan, shape = (DRY, TINY) if args.dry_run else (FULL, LLAMA3_8B)
    workdir = Path(args.workdir)
    device = "cpu" if args.dry_run else "cuda"
    model_dir = build_model(workdir / ("tiny-llama" if args.dry_run else "llama3-8b-random"),
                            shape, device)
    common = dict(platform="nvidia", dtype="bfloat16", enable_prefix_caching=False,
                  max_num_seqs=max(plan.big_batch, 1), long_prefill_token_threshold=0,
                  max_num_batched_tokens=max(plan.prefill_len, plan.big_batch * plan.prompt_len))
    if args.dry_run:
        common["num_kv_blocks"] = 64
    else:  # batch 64 x 257 tokens is 2.1 GB of KV; the core's default pool is 2 GiB
        common["kv_cache_memory_bytes"] = 24 << 30
    llm = LLM(str(model_dir), **common)
    active = llm.engine.platform
    hw = active.hardware_spec()
    matmul, lm_head = params(shape)
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * (
        shape["hidden_size"] // shape["num_attention_heads"]) * 2
    weight_bytes = 2 * (matmul + lm_head)
    rows = []
    for batch in (1, plan.big_batch):
        step = decode_step_s(llm, batch, plan, shape["vocab_size"])
        mean_ctx = plan.prompt_len + plan.decode_tokens / 2
        moved = weight_bytes + batch * mean_ctx * kv_per_token
        rows.append((f"decode, batch {batch}", step * 1e3, moved / step / 1e12,
                     "TB/s", moved / step / hw.memory_bandwidth, "HBM bandwidth", 0.8))
    graphs = getattr(llm.engine.executor.worker.runner, "decode_graphs", None)
    replays = graphs.num_replays if graphs is not None else 0
    prompt = [[(11 * j) % (shape["vocab_size"] - 2) + 2 for j in range(plan.prefill_len)]]
    timed_generate(llm, prompt, 1)  # warm-up
    prefill = min(timed_generate(llm, prompt, 1) for _ in range(plan.repeats + 1))
    head = shape["hidden_size"] // shape["num_attention_heads"]
    attention = 2 * plan.prefill_len**2 * head * shape["num_attention_heads"] * shape[
        "num_hidden_layers"]
    flops = 2 * matmul * plan.prefill_len + attention + 2 * lm_head
    peak = measured_peak(plan.matmul_n, torch.device(device))
    rows.append((f"prefill, {plan.prefill_len} tokens", prefill * 1e3, flops / prefill / 1e12,
                 "TFLOP/s", flops / prefill / peak, "measured bf16 matmul peak", 0.6))
    versions = {name: _version(name) for name in
                ("tokenmill", "tokenmill-triton", "tokenmill-nvidia", "torch", "triton")}
    if torch.version.cuda:
        versions["CUDA"] = torch.version.cuda
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip() or "unknown"
    return {
        "dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit, "versions": versions, "device": hw.name,
        "bandwidth": hw.memory_bandwidth, "bf16_peak": hw.peak_flops["bfloat16"],
        "measured_peak": peak, "replays": replays, "rows": rows,
    }


def report(args: argparse.Namespace, measured: dict) -> str:
    """The Markdown report of `measured` (from `run`), with the certificate's verdict and the
    kernel table when their files exist."""
    replays = measured["replays"]
    lines = [
        "# Hardware results: nvidia plugin" + (" (dry run, not hardware figures)"
                                                if measured["dry_run"] else ""),
        "",
        f"- date: {measured['date']}, commit {measured['commit']}",
        f"- device: {measured['device']}; declared {measured['bandwidth'] / 1e12:.2f} TB/s HBM, "
        f"bf16 {measured['bf16_peak'] / 1e12:.0f} TFLOP/s; measured bf16 matmul peak "
        f"{measured['measured_peak'] / 1e12:.0f} TFLOP/s",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in measured["versions"].items()),
        "- model: tiny random Llama (dry run)" if measured["dry_run"]
        else "- model: random-weight Llama-3-8B shape in bf16 (tokenmill.LLM)",
        f"- decode steps replayed from CUDA graphs: {replays}"
        + (" (none: every step ran eagerly)" if replays == 0 else ""),
        "",
        "| case | ms per step | achieved | roofline | fraction | goal |",
        "|---|---|---|---|---|---|",
    ]
    for case, ms, rate, unit, fraction, roof, goal in measured["rows"]:
        verdict = "met" if fraction >= goal else "not met"
        lines.append(f"| {case} | {ms:.2f} | {rate:.3g} {unit} | {roof} | {fraction:.0%} | "
                     f">= {goal:.0%}: {verdict} |")
    if args.certificate and Path(args.certificate).exists():
        cert = json.loads(Path(args.certificate).read_text())
        tiers = ", ".join(f"{t['tier']} {t['status']}" for t in cert["tiers"])
        verdict = "CERTIFIED" if cert["certified"] else "NOT CERTIFIED"
        lines += ["", f"Conformance ({Path(args.certificate).name}): {verdict}; {tiers}"]
    if args.kernels and Path(args.kernels).exists():
        lines += ["", "## Kernels (benchmarks/bench_triton.py)", "",
                  Path(args.kernels).read_text().strip()]
    return "\n".join(lines) + "\n"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the Markdown report to write")
    parser.add_argument("--certificate", help="a conformance certificate (JSON) to summarise")
    parser.add_argument("--kernels", help="bench_triton.py's Markdown table to include")
    parser.add_argument("--workdir", default="/tmp/tokenmill-hardware")
    parser.add_argument("--dry-run", action="store_true", help="tiny model, tiny lengths")
    parser.add_argument("--results", help="the measurements as JSON (default: in --workdir)")
    parser.add_argument("--render-only", action="store_true",
                        help="measure nothing: rewrite --out from --results (e.g. once the "
                        "certificate exists)")
    args = parser.parse_args(argv)
    results = Path(args.results or Path(args.workdir) / "llama-results.json")
    if args.render_only:
        measured = json.loads(results.read_text())
    else:
        measured = run(args)
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(measured, indent=2) + "\n")
    text = report(args, measured)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
