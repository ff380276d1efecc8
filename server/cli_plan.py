"""`tokenmill plan`: which parallel mix serves a model on a cluster best, and why
(tokenmill.planner; docs/planner.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="choose the parallel mix for a model x cluster x workload",
        description="Rank every valid mix (tp, pp, dp, ep, sp, pcp, dcp, xPyD splits) by "
                    "predicted TTFT, TPOT and tokens/s per device; say why the first wins.")
    p.add_argument("--model", default=None,
                   help="a shipped config (deepseek-v3, qwen3-32b, qwen3-next-80b-a3b, "
                        "kimi-linear-48b-a3b, gpt-oss-120b, llama-3-70b), a config.json, an "
                        "HF directory or a .gguf file (default: the embedded default model)")
    p.add_argument("--cluster", default=None,
                   help="NODESxDEVICESxKIND[,nvlink=900GB/s,ib=400Gb/s] or a YAML file; KIND "
                        "from a plugin's hardware table (H200, B200, MI300X, TPU v5e) or cpu")
    p.add_argument("--workload", default=None,
                   help="isl=N,osl=N[,rate=R][,concurrency=N][,hit=F], or a trace file or "
                        "directory (Mooncake .jsonl, agent session .json)")
    p.add_argument("--slo", default=None, help="ttft=300ms,tpot=10ms")
    p.add_argument("--pool", choices=["prefill", "decode", "both"], default=None,
                   help="plan a pool serving one role of a disaggregated deployment (both: "
                        "colocated only); default: colocated and every xPyD split")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--top", type=int, default=10, help="candidates shown (table)")
    p.add_argument("--apply", action="store_true",
                   help="print the tokenmill serve (and router) command lines of the first")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the model's dtype; --calibrate measures the kernels in it, and the "
                        "plan uses the calibration stored for it (default bfloat16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the step's token budget assumed (default 8192; 2048 on cpu)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--long-prefill-token-threshold", type=int, default=None)
    p.add_argument("--memory-utilization", type=float, default=0.9)
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="efficiency factors: a calibration file or a conformance certificate "
                        "(default: the stored calibration of the device, if any)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure GEMMs, attention kinds and collectives on this machine "
                        "through the active plugin and store the efficiency factors")
    p.add_argument("--platform", default=None, help="the plugin --calibrate measures")
    p.add_argument("--calibrate-ranks", default="1,2",
                   help="process-group sizes --calibrate measures collectives (and shared-host "
                        "efficiencies) on")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenmill plan: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import torch

    from tokenmill import planner
    from tokenmill.planner import calibration as cal_io
    from tokenmill.planner import report
    from tokenmill.planner.catalog import model_shape
    from tokenmill.planner.cluster import parse_cluster
    from tokenmill.planner.workload import parse_workload

    calibration = None
    if args.calibrate:
        from tokenmill.planner.calibrate import calibrate

        ranks = tuple(int(n) for n in args.calibrate_ranks.split(","))
        calibration, path = calibrate(args.platform, ranks, progress=sys.stderr, dtype=args.dtype)
        print(f"calibration stored in {path}", file=sys.stderr)
        if args.cluster is None and args.workload is None:
            return 0
    if args.cluster is None or args.workload is None:
        raise ValueError("--cluster and --workload are required (or --calibrate alone)")
    cluster = parse_cluster(args.cluster)
    if args.calibration:
        calibration = cal_io.load(Path(args.calibration))
    elif calibration is None:  # the kernels measured in the model's dtype, where stored
        calibration = cal_io.stored(cluster.device.name, args.dtype)
    dtype = getattr(torch, args.dtype)
    model = model_shape(args.model, dtype)
    budget = args.max_num_batched_tokens or (2048 if cluster.shared_host else 8192)
    limits = planner.Limits(budget, args.max_num_seqs, args.long_prefill_token_threshold,
                            args.memory_utilization)
    workload = parse_workload(args.workload)
    result = planner.plan(model, cluster, workload, planner.parse_slo(args.slo), limits,
                          calibration, args.pool)
    if args.format == "json":
        print(json.dumps(report.to_json(result.candidates), indent=1))
        return 0
    source = (f"calibrated on {calibration.device}" if calibration.calibrated
              else "uncalibrated (default efficiencies; `tokenmill plan --calibrate`)")
    print(f"model {model.name}: {model.num_params / 1e9:.2f}B parameters "
          f"({model.active_params / 1e9:.2f}B active), {model.num_layers} layers")
    print(f"cluster {cluster.describe()}; {source}")
    print(f"workload {workload.describe()}; SLO {args.slo or 'none'}")
    print(f"{len(result.candidates)} candidates; ranked by SLO met, then tokens/s per device "
          "(output tokens; a prefill pool's prompt tokens)\n")
    print(report.table(result.candidates, args.top))
    print("\n" + report.why(result.candidates))
    if args.apply and result.candidates:
        print()
        for line in report.apply_commands(result.candidates[0], args.model or "", limits,
                                          cluster.devices_per_node):
            print(line)
    return 0
