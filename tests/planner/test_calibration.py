"""Calibration: the fits recover the efficiencies, tile width and link figures that
generated their data; the figures round-trip through JSON and a certificate; collectives
measured in a real two-process group fit to positive latency and bandwidth; stored
efficiencies change the predictions."""

from __future__ import annotations

import math

import pytest

from tokenmill.planner.calibrate import fit_collectives, fit_efficiency, fit_width, run_group
from tokenmill.planner.calibration import (
    Calibration,
    Efficiency,
    from_certificate,
    from_json,
    load,
    save,
    to_json,
)
from tokenmill.planner.ops import gemm

PEAK, BANDWIDTH = 1e12, 1e11


def point(cost, seconds):
    return {"name": "x", "op": cost.op, "flops": cost.flops, "bytes": cost.bytes,
            "inner": cost.inner, "outer": cost.outer, "seconds": seconds}


def timed_gemm(rows, k, n, compute, memory, width):
    cost = gemm(rows, k, n, 2, 2)
    shape = Calibration(gemm_width=width).shape_factor(k, n)
    return point(cost, max(cost.flops / (PEAK * compute * shape), cost.bytes / (BANDWIDTH * memory)))


def test_fits_recover_the_efficiencies_and_width_that_made_the_data():
    points = [timed_gemm(r, k, n, 0.6, 0.75, 64) for r, k, n in
              [(512, 2048, 2048), (512, 256, 2048), (512, 2048, 128), (512, 1024, 1024),
               (1, 4096, 4096), (2, 2048, 4096)]]
    width = fit_width(points, PEAK)
    assert width == 64
    eff = fit_efficiency(points, PEAK, BANDWIDTH, width)["gemm"]
    assert eff.compute == pytest.approx(0.6, rel=1e-6) and eff.memory == pytest.approx(0.75, rel=1e-6)


def test_collective_fit_recovers_latency_and_bandwidth():
    n, latency, bandwidth = 4, 20e-6, 3e9
    hops = math.ceil(math.log2(n))
    sizes = (256, 4096, 65536, 1 << 20, 4 << 20)
    timings = {
        "all_reduce": {str(s): 2 * hops * latency + 2 * (n - 1) / n * s / bandwidth for s in sizes},
        "all_gather": {str(s): hops * latency + (n - 1) / n * s / bandwidth for s in sizes},
        "send": {str(s): latency + s / bandwidth for s in sizes},
    }
    fits = fit_collectives(timings, n)
    for op in timings:
        assert fits[op].latency == pytest.approx(latency, rel=1e-6), op
        assert fits[op].bandwidth == pytest.approx(bandwidth, rel=1e-6), op


def test_calibration_round_trips_and_reads_a_certificate(tmp_path):
    cal = Calibration(device="dev", platform="cpu",
                      efficiency={"gemm": Efficiency(0.5, 0.9)}, gemm_width=32,
                      per_ranks={2: {"gemm": Efficiency(0.3, 0.4)}}, step_overhead_s=0.002)
    assert from_json(to_json(cal)) == cal
    assert load(save(cal, tmp_path / "c.json")).efficiency_for("gemm", 2) == Efficiency(0.3, 0.4)
    cert = {"platform": "cpu", "hardware": {"spec": {"name": "AMD EPYC"}}, "performance": {
        "matmul": {"bfloat16": {"fraction_of_declared": 0.42}},
        "memory_bandwidth": {"fraction_of_declared": 0.61}}}
    read = from_certificate(cert)
    assert read.device == "AMD EPYC" and read.efficiency["gemm"] == Efficiency(0.42, 0.61)
    cert["performance"]["calibration"] = to_json(cal)  # a T5 report carrying ours whole
    assert from_certificate(cert) == cal
    with pytest.raises(ValueError, match="neither a calibration file"):
        from_certificate({"performance": {}})


def test_collectives_of_a_real_two_process_group_fit():
    group = run_group(2, "cpu", quick=True, kernels=False)
    fits = fit_collectives(group["collectives"], 2)
    assert set(fits) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"}
    for fit in fits.values():
        assert 0 < fit.latency < 0.05 and fit.bandwidth > 1e7


def test_stored_efficiencies_change_the_prediction():
    from tokenmill.planner.catalog import model_shape
    from tokenmill.planner.cluster import parse_cluster
    from tokenmill.planner.mixes import Mix
    from tokenmill.planner.ops import Seq
    from tokenmill.planner.step import step_time

    model, cluster = model_shape("llama-3-70b"), parse_cluster("1x8xH200")
    seqs = (Seq(0, 4096),)
    base = step_time(model, Mix(tp=8), cluster, Calibration(), seqs, 1)
    halved = Calibration(efficiency={op: Efficiency(e.compute / 2, e.memory)
                                     for op, e in Calibration().efficiency.items()})
    slow = step_time(model, Mix(tp=8), cluster, halved, seqs, 1)
    assert slow.compute_s == pytest.approx(2 * base.compute_s, rel=0.01)
