"""Predicted against measured: the planner's TTFT, TPOT and throughput for every mix that
runs on this machine, beside what the engine does with it.

Each case starts an `LLM` with the mix (cpu plugin, bf16, the platform's step settings:
2048-token budget, 512-token prompt chunks), runs a closed loop of C clients, each sending
ISL-token prompts for OSL greedy tokens (no prefix caching) until R requests finished (twice;
the faster run counts), and times every request (TTFT: added -> first token; TPOT: the mean gap
after it; throughput: output tokens / wall time while every client is busy). The clients start
staggered, client k after k x OSL / C engine steps (over HTTP: k / C of a request's time), so
that, as with arrivals at random times, a prompt lands beside the others' decodes instead of
every client's prompt in one step for ever (a lock-step loop of equal requests measures
TPOT as a bare decode step and TTFT as a step of C prompts, which the planner does not
predict); the first request of each client (its ramp) is left out of the means. The planner predicts the same mix for the same workload on
the cluster `1x4xcpu` with the calibration stored by `tokenmill plan --calibrate`
(`--calibrate` measures it first, in the same run). Models: the default SmolLM2-135M
GGUF (9 query heads: no tp 2), and random "small" models of the hybrid families built
from their configs (hidden 512, 8 layers; qwen3 dense, Qwen3-Next: Gated DeltaNet +
gated attention + MoE, Bamba: Mamba2 + attention).

1P1D (qwen3): `tokenmill router` in front of one
`serve --kv-role prefill` and one `serve --kv-role decode` server, the same closed loop as
streamed completions over loopback (so it also pays HTTP and the router, which the
in-process engines do not). dpN: one `serve -dp N` over the same loop, since `LLM`
steps its in-process replicas in turn and the planner predicts replicas that run at once.

`--save FILE.json` writes every row (measured and predicted figures) and the calibration
used; `--calibration FILE` predicts with a saved calibration (a `--save` file or a
calibration file) instead of the stored one; `--repredict FILE.json` runs no engine and
prints the saved measurements beside the planner's predictions of today (a model change
priced against a run's measurements), with the run's calibration unless `--calibration`
names another.

Usage: python benchmarks/bench_planner.py [--calibrate] [--cases default,qwen3,qwen3_next,bamba]
       [--isl 256] [--osl 32] [--clients 4] [--requests 8] [--only default:tp1,qwen3:tp2]
       [--save run.json] [--calibration FILE] [--repredict run.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF reader's progress bars, once per rank

import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MIXES = {  # the first of each is the reference of the ratio columns
    "default": ["tp1", "pp2", "dp2", "dcp2", "pcp2"],
    "qwen3": ["tp1", "tp2", "tp2 x sp", "pp2", "tp2 x pp2", "dcp2", "1P1D"],
    "qwen3_next": ["tp1", "tp2", "tp2 x ep2", "pp2"],
    "bamba": ["tp1", "tp2", "pp2"],
}
SMALL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64)


def small_model(root: Path, arch: str) -> Path:
    """A random model of `arch` at the SMALL widths, with the tiny models' tokenizer."""
    import torch
    from tiny_models import make_config, make_tokenizer
    from transformers import AutoModelForCausalLM

    path = root / arch
    tokenizer = make_tokenizer(300)
    config = make_config(arch, len(tokenizer))
    for key, value in SMALL.items():
        setattr(config, key, value)
    config.max_position_embeddings = 4096  # the tiny configs' 16 leaves no room for a prompt
    if arch == "qwen3_next":
        config.layer_types = ["linear_attention", "linear_attention", "linear_attention",
                              "full_attention"] * 2
        config.linear_num_key_heads, config.linear_num_value_heads = 4, 8
        config.linear_key_head_dim = config.linear_value_head_dim = 64
        config.num_experts, config.moe_intermediate_size = 8, 256
        config.shared_expert_intermediate_size = 256
        config.mlp_only_layers = []
    if arch == "bamba":
        config.attn_layer_indices = [3, 7]
        config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups = 16, 64, 2
        config.mamba_d_state, config.mamba_expand = 64, 2
    if arch not in ("qwen3_next", "bamba") and getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * SMALL["num_hidden_layers"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def mix_of(label: str):
    from tokenmill.planner.mixes import Mix

    fields = {}
    for part in label.split(" x "):
        name, size = part.rstrip("0123456789"), part[len(part.rstrip("0123456789")):]
        if name == "sp":
            fields["sp"] = True
        elif name == "ep":
            fields["ep"] = True
        else:
            fields[name] = int(size)
    return Mix(**fields)


def engine_kwargs(mix) -> dict:
    kw = {"tensor_parallel_size": mix.tp, "pipeline_parallel_size": mix.pp,
          "data_parallel_size": mix.dp, "decode_context_parallel_size": mix.dcp,
          "prefill_context_parallel_size": mix.pcp}
    kw = {k: v for k, v in kw.items() if v > 1}
    if mix.ep:
        kw["enable_expert_parallel"] = True
    if mix.sp:
        kw["enable_sequence_parallelism"] = True
    return kw


def measure(path: str, mix, isl: int, osl: int, clients: int, requests: int) -> dict:
    """TTFT, TPOT and throughput of a closed loop of `clients` on the engine."""
    from tokenmill import LLM, SamplingParams

    # weights dense in bf16 for every mix, as the planner prices them: unset, a GGUF runs
    # quantized at tp1 and dequantized under tensor parallel (docs/quantization.md)
    llm = LLM(path, platform="cpu", dtype="bfloat16", enable_prefix_caching=False,
              quantization="none", max_num_seqs=max(clients, 8), **engine_kwargs(mix))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=osl, ignore_eos=True)
    vocab = engine.replicas[0].loaded.hf_config.vocab_size if hasattr(engine, "replicas") else (
        engine.loaded.hf_config.vocab_size)
    try:
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate({"prompt_token_ids": list(range(10, 10 + isl))}, warm, use_tqdm=False)
        sent, added, first, done, counts = 0, {}, {}, {}, {}
        ramp = {f"r{k}" for k in range(clients)}  # each client's first request
        window = [None, None, 0]  # all clients busy: start, end, tokens made in it

        def submit() -> None:
            nonlocal sent
            rid = f"r{sent}"
            prompt = [(7 + 31 * sent + 13 * j) % (vocab - 20) + 10 for j in range(isl)]
            added[rid] = time.perf_counter()
            engine.add_request(rid, prompt, params)
            sent += 1
            if sent == min(clients, requests):
                window[0] = added[rid]

        steps, gap = 0, max(1, osl // clients)  # client k starts after k x gap steps
        submit()
        while engine.has_unfinished_requests() or sent < min(clients, requests):
            if sent < min(clients, requests) and steps >= sent * gap:
                submit()
            made, counting = 0, window[1] is None  # the step that closes the window counts
            for out in engine.step():
                now = time.perf_counter()
                n = len(out.outputs[0].token_ids)
                if n and out.request_id not in first:
                    first[out.request_id] = now
                made += n - counts.get(out.request_id, 0)
                counts[out.request_id] = n
                if out.finished:
                    done[out.request_id] = now
                    if sent < requests:
                        submit()
                    elif window[1] is None:
                        window[1] = now  # a client goes idle: the drain begins
            steps += 1
            if window[0] is not None and counting:
                window[2] += made
    finally:
        engine.shutdown()
    steady = [r for r in done if r not in ramp] or list(done)
    ttft = [first[r] - added[r] for r in steady]
    tpot = [(done[r] - first[r]) / (counts[r] - 1) for r in steady if counts[r] > 1]
    return {"ttft": statistics.mean(ttft), "tpot": statistics.mean(tpot),
            "throughput": window[2] / (window[1] - window[0])}


def measure_served(path: str, isl: int, osl: int, clients: int, requests: int,
                   dp: int = 1) -> dict:
    """The same closed loop over HTTP (streamed completions over loopback): `dp` 1, through
    `tokenmill router` in front of one `serve --kv-role prefill` and one `--kv-role decode`
    server (1P1D); `dp` > 1, one `serve -dp N`, whose replicas are engine processes that
    step in parallel (`LLM(data_parallel_size=N)` steps its in-process replicas in turn,
    which is not the deployment the planner predicts)."""
    import threading

    import openai

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "disagg"))
    from pd_cluster import Proc

    flags = ["--served-model-name", "m", "--platform", "cpu", "--dtype", "bfloat16",
             "--quantization", "none",  # as measure(): the weights the planner prices
             "--max-num-seqs", str(max(clients, 8)),  # P/D needs the prefix cache (no hits here)
             "--log-level", "warning"]
    logs = Path(tempfile.mkdtemp())
    if dp > 1:
        procs = [Proc(["serve", path, "-dp", str(dp), *flags], logs / "dp.log")]
    else:
        procs = [Proc(["serve", path, "--kv-role", role, *flags], logs / f"{role}.log")
                 for role in ("prefill", "decode")]
    try:
        for p in procs:
            p.wait_ready(900)
        if dp == 1:
            procs.append(Proc(["router", "--prefill", procs[0].url, "--decode", procs[1].url,
                               "--log-level", "warning"], logs / "router.log"))
            procs[-1].wait_ready(300)
        client = openai.OpenAI(base_url=procs[-1].url + "/v1", api_key="unused", max_retries=0,
                               timeout=3600)
        lock, sent, times = threading.Lock(), [0], []
        from tokenmill.model.loader import load_model_info  # a directory or a GGUF file

        vocab = load_model_info(path, load_tokenizer=False).hf_config.vocab_size

        def one(i: int, k: int, ramp: bool = True) -> None:  # the in-process loop's prompts
            prompt = [(7 + 31 * i + 13 * j) % (vocab - 20) + 10 for j in range(isl)]
            t0, first = time.perf_counter(), None
            for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=osl,
                                                   temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True}):
                if chunk.choices and first is None:
                    first = time.perf_counter()
            times.append((t0, first, time.perf_counter(), k, ramp))

        def loop(k: int) -> None:
            time.sleep(k * alone / clients)  # staggered starts, as in `measure`
            ramp = True
            while True:
                with lock:
                    if sent[0] >= requests:
                        return
                    sent[0] += 1
                    i = sent[0]
                one(i, k, ramp)
                ramp = False

        one(requests + 1, -1)  # warm both servers, then time one request alone (other
        one(requests + 2, -1)  # prompts than the loop's: the prefix cache is on)
        alone = times[-1][2] - times[-1][0]
        times.clear()
        threads = [threading.Thread(target=loop, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for p in procs:
            p.stop()
    # every client busy: from the last client's start until the first client goes idle
    start = max(t0 for t0, _, _, _, ramp in times if ramp)
    end = min(max(d for *_, d, k2, _ in times if k2 == k) for k in {k for *_, k, _ in times})
    steady = [(t0, f, d) for t0, f, d, _, ramp in times if not ramp] or [
        (t0, f, d) for t0, f, d, _, _ in times]
    # output tokens made in the window: each stream's tokens spread over its decode time
    made = sum(osl * max(0.0, min(d, end) - max(f, start)) / max(d - f, 1e-9)
               for t0, f, d, _, _ in times)
    return {"ttft": statistics.mean(f - t0 for t0, f, _ in steady),
            "tpot": statistics.mean((d - f) / (osl - 1) for _, f, d in steady),
            "throughput": made / (end - start)}


def context(path: str, isl: int, osl: int, clients: int, calibration):
    import torch

    from tokenmill.planner.calibration import for_spec
    from tokenmill.planner.catalog import model_shape
    from tokenmill.planner.cluster import parse_cluster
    from tokenmill.planner.serving import SLO, Context, Limits
    from tokenmill.planner.workload import Workload

    shape = model_shape(path, torch.bfloat16)
    cluster = parse_cluster("1x4xcpu")
    return Context(shape, cluster, for_spec(calibration, cluster.device),
                   Workload(isl, osl, concurrency=clients), SLO(),
                   Limits(2048, max(clients, 8), 512))


def predict(path: str, mix, isl: int, osl: int, clients: int, calibration) -> dict:
    from tokenmill.planner.serving import predict_colocated

    p = predict_colocated(context(path, isl, osl, clients, calibration), mix)
    return {"ttft": p.ttft_s, "tpot": p.tpot_s, "throughput": p.tokens_per_s_per_device * mix.devices,
            "binding": p.binding}


def predict_pd(path: str, isl: int, osl: int, clients: int, calibration) -> dict:
    """1P1D: a tp1 prefill instance and a tp1 decode instance, as the search costs a split
    (on this shared host, each pool beside the other's rank)."""
    from tokenmill.planner.mixes import Mix
    from tokenmill.planner.search import split
    from tokenmill.planner.serving import predict_decode, predict_prefill

    ctx = context(path, isl, osl, clients, calibration)
    c = split(ctx, predict_prefill(ctx, Mix()), predict_decode(ctx, Mix()), 1, 1)
    return {"ttft": c.ttft_s, "tpot": c.tpot_s, "throughput": c.tokens_per_s_per_device * 2,
            "binding": c.binding}


def rank(values: dict[str, float]) -> list[str]:
    return sorted(values, key=values.__getitem__, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--cases", default="default,qwen3,qwen3_next,bamba")
    parser.add_argument("--isl", type=int, default=256)
    parser.add_argument("--osl", type=int, default=32)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--only", default=None, help="these mixes only, e.g. tp1,pp2 or default:tp1,qwen3:tp2")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mix; the fastest counts")
    parser.add_argument("--quick-calibration", action="store_true")
    parser.add_argument("--save", type=Path, default=None, help="write the rows and calibration here (JSON)")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="a --save file or calibration file to predict with")
    parser.add_argument("--repredict", type=Path, default=None,
                        help="a --save file: its measurements against today's predictions, no engine")
    args = parser.parse_args()

    from tokenmill.model.loader import default_model_path
    from tokenmill.planner import calibration as cal_io
    from tokenmill.platforms.registry import load_platform

    saved = json.loads(args.repredict.read_text()) if args.repredict else None
    if saved is not None:
        w = saved["workload"]
        args.isl, args.osl, args.clients, args.requests = w["isl"], w["osl"], w["clients"], w["requests"]
        args.cases = ",".join(dict.fromkeys(r["case"] for r in saved["rows"]))
    if args.calibrate and saved is None:
        from tokenmill.planner.calibrate import calibrate

        calibration, where = calibrate("cpu", (1, 2, 4), quick=args.quick_calibration,
                                       progress=sys.stderr, dtype="bfloat16")
        print(f"calibrated: {where}")
    elif saved is not None and not args.calibration:
        calibration = cal_io.from_json(saved["calibration"], str(args.repredict))
    elif args.calibration:
        data = json.loads(args.calibration.read_text())
        calibration = (cal_io.from_json(data["calibration"], str(args.calibration)) if "rows" in data
                       else cal_io.load(args.calibration))
    else:
        calibration = cal_io.stored(load_platform("cpu").hardware_spec().name, "bfloat16")
    print(f"calibration: {calibration.device} ({'measured' if calibration.calibrated else 'defaults'})")
    print(f"workload: ISL {args.isl}, OSL {args.osl}, {args.clients} clients, "
          f"{args.requests} requests\n")
    print("| model | mix | TTFT ms pred / meas | err | TPOT ms pred / meas | err "
          "| tok/s pred / meas | err | tok/s vs the first, pred / meas | binding |")
    print("|---|---|---|---:|---|---:|---|---:|---|---|")
    record = {"workload": {"isl": args.isl, "osl": args.osl, "clients": args.clients,
                           "requests": args.requests, "repeats": args.repeats},
              "calibration": cal_io.to_json(calibration), "rows": []}
    root = Path(tempfile.mkdtemp())
    for case in args.cases.split(","):
        path = default_model_path() if case == "default" else str(small_model(root, case))
        predicted, measured = {}, {}
        for label in MIXES[case]:
            if saved is not None:
                rows = [r for r in saved["rows"] if r["case"] == case and r["mix"] == label]
                if not rows:
                    continue
            elif args.only and not {label, f"{case}:{label}"} & set(args.only.split(",")):
                continue
            if label == "1P1D":
                p = predict_pd(path, args.isl, args.osl, args.clients, calibration)
                run = partial(measure_served, path, args.isl, args.osl, args.clients, args.requests)
            else:
                mix = mix_of(label)
                p = predict(path, mix, args.isl, args.osl, args.clients, calibration)
                if mix.dp > 1 and mix.devices == mix.dp:  # served: replicas step in parallel
                    run = partial(measure_served, path, args.isl, args.osl, args.clients,
                                  args.requests, dp=mix.dp)
                else:
                    run = partial(measure, path, mix, args.isl, args.osl, args.clients,
                                  args.requests)
            if saved is not None:
                m = rows[0]["measured"]
            else:
                started = time.time()
                runs = [run() for _ in range(args.repeats)]
                m = max(runs, key=lambda r: r["throughput"])  # the run least slowed by other work
            predicted[label], measured[label] = p["throughput"], m["throughput"]
            errs = [p[k] / m[k] - 1 for k in ("ttft", "tpot", "throughput")]
            first = next(iter(predicted))
            ratios = (predicted[label] / predicted[first], measured[label] / measured[first])
            if saved is None:
                record["rows"].append({"case": case, "mix": label, "measured": m, "predicted": p,
                                       "started_utc": time.strftime("%H:%M:%S", time.gmtime(started)),
                                       "seconds": round(time.time() - started, 1),
                                       "load": os.getloadavg()})
                if args.save:
                    args.save.write_text(json.dumps(record, indent=1))
            print(f"| {case} | {label} | {p['ttft'] * 1e3:.0f} / {m['ttft'] * 1e3:.0f} | "
                  f"{errs[0]:+.0%} | {p['tpot'] * 1e3:.1f} / {m['tpot'] * 1e3:.1f} | {errs[1]:+.0%} | "
                  f"{p['throughput']:.1f} / {m['throughput']:.1f} | {errs[2]:+.0%} | "
                  f"{ratios[0]:.2f} / {ratios[1]:.2f} | {p['binding']} |", flush=True)
        same = rank(predicted) == rank(measured)
        print(f"| {case} | ranking by throughput | predicted {' > '.join(rank(predicted))} | | "
              f"measured {' > '.join(rank(measured))} | | {'equal' if same else 'differs'} | | | |",
              flush=True)


if __name__ == "__main__":
    main()
