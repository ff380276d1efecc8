"""Communication volume per token of tensor, pipeline and data parallel, counted at the
communicator; and what this machine shows of their scaling.

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

Pipeline parallel (pp = 2, alone and with tp = 2 in each stage): every rank's "pp"
communicator counts what it sends or receives, the pair (hidden, residual) per token at
the stage boundary:

    per token, per rank, pp payload = 2 * hidden * dtype_bytes   (sent by stage 0,
        received by stage 1; with tp each TP rank hands its replicated copy on)
    tp payload per token: stage 0 (2 * its layers + 1) * hidden * dtype_bytes,
        the last stage 2 * its layers * hidden * dtype_bytes + the logits all_gather

Data parallel (dp = 2 x tp = 2): replicas share no process group, so the only bytes
are each replica's own TP traffic for the requests it ran (the tp formula); the
cross-replica figure is 0 by construction, and the script checks the idle replica's
count stays 0.

`--section scaling`: generation throughput of N greedy requests on uni, mp tp2, mp pp2
and dp2 in one run, as ratios to uni.

`--section mix`: expert, sequence and context parallel (and their mixes with tp) on a
tiny llama and Mixtral, float32: every rank's counts of every group ("tp", "dcp",
"pcp") and collective, summed over the ranks, per decode token and per prefill, beside
the formula. Notation: L layers, H hidden, b dtype bytes, V vocab, k experts per token,
Hq query heads, D head size, KVh KV heads, T a step's tokens, t the TP size.

- tp: per rank (2L+1) T H b all_reduce (o_proj, down_proj, embedding) + t ceil(V/t) b
  all_gather per sampled row (logits), the same on each of the t ranks.
- tp + sp: the all_reduces become reduce_scatter + all_gather of T' = t ceil(T/t)
  rows each (plus the final hidden states' all_gather): 2 (2L+1) T' H b + logits.
- MoE tp (experts' intermediate split): as tp. ep (enable_expert_parallel): the MoE
  layers' all_reduce goes, (L+1) T H b stays per rank; per MoE layer, summed over the
  ranks, t^2 x 8 (row counts, all_to_all) + T k (2 H b + 8) (rows and their expert ids
  out, outputs back, all_to_all_single) + t^2 ceil(T/t) H b (all_gather of the slices).
- DeepSeek-V3 (MLA split by heads, dense first layer, shared experts) and Qwen3-Next
  (Gated DeltaNet by key-head groups, a dense layer, a gated shared expert): tp as the
  llama formula, (2L+1) T H b per rank: the shared experts' partial sum joins the routed
  experts' one all-reduce. ep: the dense layers keep their MLP's all-reduce and a MoE
  layer's shared experts are reduced alone, so (L+1 + dense + shared MoE) T H b per rank
  stays, plus the all-to-all and all-gather terms of the MoE layers only.
- dcp n (x tp t): per rank and layer n T (Hq/t) (D+1) x 4 (float32 partial outputs and
  log-sum-exps, all_gather), besides tp's own.
- pcp n (x tp t): a step of T >= 2n tokens, per rank: L x 2 n ceil(T/n) (KVh/t) D b
  (keys and values, all_gather) + n ceil(T/n) H b (final hidden states); each pcp rank's
  tp group all-reduces its slice only (the slices add up to T). Decode steps run whole.

Usage: python benchmarks/bench_tp_comm.py [--prompt-tokens 32] [--decode-tokens 16]
       [--section tp|pp|dp|mix|scaling|all] [--models deepseek_v3,qwen3_next]
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


def counted_by_rank(llm: LLM, dims: tuple[str, ...]) -> dict[str, list[int]]:
    rpc = llm.engine.executor.collective_rpc
    return {d: rpc("communicated_bytes", (d,)) for d in dims}


def measure_ranks(llm: LLM, dims: tuple[str, ...], prompt: list[int], decode: int) -> dict:
    """Per dim, per rank: bytes of a prefill of `prompt` (+1 sampled token) and per decode
    token after it."""
    def run(max_tokens: int) -> dict[str, list[int]]:
        before = counted_by_rank(llm, dims)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        after = counted_by_rank(llm, dims)
        return {d: [a - b for a, b in zip(after[d], before[d])] for d in dims}

    prefill, both = run(1), run(1 + decode)
    return {d: (prefill[d], [(b - p) / decode for b, p in zip(both[d], prefill[d])])
            for d in dims}


def pp_section(path: Path, prompt: list[int], decode: int) -> None:
    from tokenmill.model.pipeline import stage_layers

    print("\n| tp x pp | dtype | rank (stage, tp) | dim | counted / decode token | formula "
          "| counted / prefill | formula |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        for tp in (1, 2):
            llm = LLM(str(path), dtype=dtype, platform="cpu", tensor_parallel_size=tp,
                      pipeline_parallel_size=2, num_kv_blocks=64, enable_prefix_caching=False)
            try:
                hf = llm.engine.loaded.hf_config
                dims = ("pp", "tp") if tp > 1 else ("pp",)
                got = measure_ranks(llm, dims, prompt, decode)
            finally:
                llm.engine.shutdown()
            h, n = hf.hidden_size, len(prompt)
            gather = tp * -(-hf.vocab_size // tp) * size
            for rank in range(2 * tp):
                stage = rank // tp
                layers = len(stage_layers(hf.num_hidden_layers, 2, stage))
                formulas = {"pp": (2 * h * size, n * 2 * h * size)}
                if tp > 1:
                    per_token = (2 * layers + (stage == 0)) * h * size
                    last = gather if stage == 1 else 0
                    formulas["tp"] = (per_token + last, n * per_token + last)
                for d in dims:
                    prefill, per_decode = got[d][0][rank], got[d][1][rank]
                    f_decode, f_prefill = formulas[d]
                    print(f"| {tp} x 2 | {dtype} | {rank} ({stage}, {rank % tp}) | {d} | "
                          f"{per_decode:.0f} | {f_decode} | {prefill} | {f_prefill} |")


def dp_section(path: Path, prompt: list[int], decode: int) -> None:
    print("\n| dp x tp | dtype | replica | counted tp bytes / rank, whole request | formula "
          "| per token of the request | cross-replica bytes |")
    print("|---|---|---|---:|---:|---:|---:|")
    tp, size, dtype = 2, 4, "float32"
    llm = LLM(str(path), dtype=dtype, platform="cpu", tensor_parallel_size=tp,
              data_parallel_size=2, num_kv_blocks=64, enable_prefix_caching=False)
    try:
        engine = llm.engine
        hf = engine.loaded.hf_config
        before = [r.executor.collective_rpc("communicated_bytes", ("tp",)) for r in engine.replicas]
        params = SamplingParams(temperature=0, max_tokens=1 + decode, ignore_eos=True)
        rid = engine.next_request_id()
        replica = engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        after = [r.executor.collective_rpc("communicated_bytes", ("tp",)) for r in engine.replicas]
    finally:
        llm.engine.shutdown()
    reduce_bytes = (2 * hf.num_hidden_layers + 1) * hf.hidden_size * size
    gather = tp * -(-hf.vocab_size // tp) * size
    for i in range(2):
        total = [a - b for a, b in zip(after[i], before[i])]
        formula_total = (len(prompt) + decode) * reduce_bytes + (1 + decode) * gather
        if i != replica:
            formula_total = 0
        num = len(prompt) + decode
        print(f"| 2 x {tp} | {dtype} | {i} | {total[0]} | {formula_total} | "
              f"{total[0] / num:.0f} | 0 |")
        assert len(set(total)) == 1, total  # both TP ranks of a replica count the same


OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_single")
DIMS = ("tp", "dcp", "pcp")
B = 4  # float32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def moe_layers(hf) -> tuple[int, bool]:
    """(how many layers are MoE, whether they have shared experts)."""
    layers = hf.num_hidden_layers
    if hf.model_type == "deepseek_v3":
        return layers - hf.first_k_dense_replace, True
    if hf.model_type == "qwen3_next":
        dense = set(hf.mlp_only_layers or [])
        step = hf.decoder_sparse_step
        return sum(i not in dense and (i + 1) % step == 0 for i in range(layers)), True
    return layers, False  # mixtral: every layer


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
            moe, shared = moe_layers(hf)
            per_rank = (layers + 1 + (layers - moe) + (moe if shared else 0)) * T * hidden * B
            k = hf.num_experts_per_tok
            total += moe * (t * t * 8 + T * k * (2 * hidden * B + 8) + t * t * cdiv(T, t) * hidden * B)
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


def measure_mix(path: Path, mode: dict, prompt: list[int], decode: int) -> dict:
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
    ("deepseek_v3", "tp2 (MLA, dense + shared + routed experts)", {"tensor_parallel_size": 2}),
    ("deepseek_v3", "ep2", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("qwen3_next", "tp2 (Gated DeltaNet + gated attention, MoE)", {"tensor_parallel_size": 2}),
    ("qwen3_next", "ep2", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("llama", "dcp2", {"decode_context_parallel_size": 2}),
    ("llama", "tp2 x dcp2", {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}),
    ("llama", "pcp2", {"prefill_context_parallel_size": 2}),
    ("llama", "tp2 x pcp2", {"tensor_parallel_size": 2, "prefill_context_parallel_size": 2}),
]


def mix_section(root: Path, prompt: list[int], decode: int,
                models: tuple[str, ...] | None = None) -> None:
    modes = [m for m in MODES if models is None or m[0] in models]
    paths = {arch: make_tiny_model(root / arch, arch) for arch in {m[0] for m in modes}}
    P = len(prompt)
    print(f"\nmixes: float32, bytes summed over ranks, P={P}, K={decode}")
    print("| model | mix | ranks | counted / decode token | formula | counted / prefill "
          f"({P} tokens) | formula |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for arch, name, mode in modes:
        got = measure_mix(paths[arch], mode, prompt, decode)
        hf = got["hf"]
        ranks = 1
        for key in ("tensor_parallel_size", "decode_context_parallel_size",
                    "prefill_context_parallel_size"):
            ranks *= mode.get(key, 1)
        decode_f, prefill_f = formula(mode, hf, 1, 1), formula(mode, hf, P, 1)
        print(f"| {arch} | {name} | {ranks} | {got['decode']:.0f} | {decode_f} | "
              f"{got['prefill']} | {prefill_f} |", flush=True)


def scaling_section(path: Path, num_requests: int, prompt_len: int, decode: int) -> None:
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 250 for j in range(prompt_len)]}
               for i in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True)
    rows = []
    for name, kw in (("uni", {}), ("mp tp2", {"tensor_parallel_size": 2}),
                     ("mp pp2", {"pipeline_parallel_size": 2}), ("dp2 (uni replicas)",
                                                                 {"data_parallel_size": 2})):
        llm = LLM(str(path), dtype="float32", platform="cpu", num_kv_blocks=512,
                  enable_prefix_caching=False, **kw)
        try:
            llm.generate(prompts[:2], params, use_tqdm=False)  # warm up
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            rows.append((name, num_requests * decode / (time.perf_counter() - start)))
        finally:
            llm.engine.shutdown()
    print(f"\n{num_requests} requests x {prompt_len} prompt + {decode} decode tokens, greedy")
    print("| config | decode tokens / s | vs uni |")
    print("|---|---:|---:|")
    for name, rate in rows:
        print(f"| {name} | {rate:.0f} | {rate / rows[0][1]:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--section", choices=["tp", "pp", "dp", "mix", "scaling", "all"], default="all")
    parser.add_argument("--models", default=None,
                        help="mix section: only these models, comma-separated (e.g. deepseek_v3)")
    args = parser.parse_args()
    path = make_tiny_model(Path(tempfile.mkdtemp()) / "llama", "llama")
    prompt = list(range(5, 5 + args.prompt_tokens))
    print(f"P={args.prompt_tokens} prompt tokens, K={args.decode_tokens} decode tokens, batch 1")
    if args.section in ("pp", "all"):
        pp_section(path, prompt, args.decode_tokens)
    if args.section in ("dp", "all"):
        dp_section(path, prompt, args.decode_tokens)
    if args.section in ("mix", "all"):
        models = tuple(args.models.split(",")) if args.models else None
        mix_section(path.parent / "mix", prompt, args.decode_tokens, models)
    if args.section in ("scaling", "all"):
        scaling_section(path, 16, args.prompt_tokens, args.decode_tokens)
    if args.section not in ("tp", "all"):
        return
    print()
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
