"""The calibration's host-overhead probe in a fresh process: raw figures, then the fit with
a calibration's collective latencies, saved with those overheads.

Usage: python overhead_probe.py CALIBRATION.json OUT.json"""
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path


def main() -> None:
    from tokenmill.planner import calibration as cal_io
    from tokenmill.planner.calibrate import overheads_from_steps
    from tokenmill.planner.engine_probe import decode_step_seconds
    cal = cal_io.load(Path(sys.argv[1]))
    raw = {}
    with tempfile.TemporaryDirectory() as tmp:
        def run(key, **kw):
            t = decode_step_seconds(Path(tmp), "cpu", dtype="bfloat16", **kw)
            raw.setdefault(key, []).append(t)
            print(f"{key}: {t * 1e3:.2f} ms", flush=True)
        for _ in range(2):
            run("two", layers=2)
            run("eight", layers=8)
        for _ in range(3):
            run("tp_two", layers=2, tensor_parallel=2)
            run("tp_eight", layers=8, tensor_parallel=2)
            run("pp_eight", layers=8, pipeline_parallel=2)
    best = {k: min(v) for k, v in raw.items()}
    fit = cal.collective_fit("all_reduce", 2)
    send = cal.collective_fit("send", 2)
    over = overheads_from_steps(best["two"], best["eight"], best["tp_two"], best["tp_eight"],
                                2 * fit.latency if fit else 0.0, cal.rank_overhead_s,
                                pp_eight=best["pp_eight"], send_latency_s=send.latency if send else 0.0)
    print(json.dumps({"raw_ms": {k: [round(x * 1e3, 2) for x in v] for k, v in raw.items()}, "fit": over}, indent=1))
    cal_io.save(replace(cal, **over), Path(sys.argv[2]))


if __name__ == "__main__":
    main()
