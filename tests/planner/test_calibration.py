"""Calibration: the fits recover the efficiencies, tile width and link figures that
generated their data; the figures round-trip through JSON and a certificate; collectives
measured in a real two-process group fit to positive latency and bandwidth; stored
efficiencies change the predictions; a calibration carries the peaks it was fitted to and,
loaded against a spec whose peaks changed, still predicts the times it measured; one
without them (format version 1) is refused with a message that says what to do."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace

import pytest

from tokenmill.planner.calibrate import (
    fit_collectives,
    fit_efficiency,
    fit_latency,
    fit_width,
    run_group,
)
from tokenmill.planner.calibration import (
    Calibration,
    Efficiency,
    Peaks,
    for_spec,
    from_certificate,
    from_json,
    load,
    save,
    to_json,
)
from tokenmill.planner.ops import gemm
from tokenmill.platforms.interfaces import HardwareSpec

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


def test_latency_fit_recovers_a_calls_fixed_cost_and_the_efficiencies_beneath_it():
    """Points made as roofline x efficiency + a fixed cost a call: the tiny point gives
    the latency, the others the efficiencies once it is taken off (without that, the
    memory-bound points would read 20% slow)."""
    latency = 40e-6
    points = [timed_gemm(r, k, n, 0.6, 0.75, 64) for r, k, n in
              [(512, 2048, 2048), (512, 256, 2048), (512, 2048, 128), (512, 1024, 1024),
               (1, 4096, 4096), (2, 2048, 4096)]]
    for p in points:
        p["seconds"] += latency
    tiny = timed_gemm(1, 64, 64, 0.6, 0.75, 64)
    tiny["seconds"] += latency
    tiny["latency"] = True
    eff, fitted = fit_latency(points + [tiny], PEAK, BANDWIDTH, 64)
    assert fitted == {"gemm": pytest.approx(latency, rel=1e-3)}
    assert eff["gemm"].compute == pytest.approx(0.6, rel=1e-3)
    assert eff["gemm"].memory == pytest.approx(0.75, rel=1e-3)
    plain = fit_efficiency(points, PEAK, BANDWIDTH, 64)["gemm"]
    assert plain.memory < 0.75 * 0.9


def test_every_call_pays_its_classs_latency_once_per_layer():
    """A step's time grows by calls x latency: per layer 2 norms, the GEMMs the model shape
    lists and the activation, times the layers (costed once per shape, `repeated`); an
    MoE layer's experts are one call for their two halves."""
    from tokenmill.planner.catalog import model_shape
    from tokenmill.planner.mixes import Mix
    from tokenmill.planner.ops import Seq, experts
    from tokenmill.planner.step import Share, op_seconds, stage_costs

    model = model_shape("qwen3-32b")
    seqs = (Seq(100, 1, 2),)
    costs = stage_costs(model, Mix(), seqs, 2)
    share = Share(PEAK, BANDWIDTH, 1)
    base, lat = Calibration(), Calibration(latency={"gemm": 1e-3, "elementwise": 1e-4})

    def total(cal):
        return sum(op_seconds(c, share, cal)[0] for c in costs)

    gemms = sum(c.calls for c in costs if c.op == "gemm")
    elementwise = sum(c.calls for c in costs if c.op == "elementwise")
    layers = len(model.layers)
    per_layer = len(model.layers[0].linears)
    assert gemms == layers * per_layer + 1  # + the logits
    assert elementwise == layers * 3 + 2  # two norms and the activation; the embedding, the final norm
    assert total(lat) - total(base) == pytest.approx(gemms * 1e-3 + elementwise * 1e-4, rel=1e-9)
    up, down = experts(4, 2, 8, 8, 2, 64, 32, 2, 2)
    assert up.calls + down.calls == 1


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
                      per_ranks={2: {"gemm": Efficiency(0.3, 0.4)}}, step_overhead_s=0.002,
                      fitted_to=Peaks("dev", {"bfloat16": 2e12}, 1e11, "bfloat16"))
    assert from_json(to_json(cal)) == cal
    assert load(save(cal, tmp_path / "c.json")).efficiency_for("gemm", 2) == Efficiency(0.3, 0.4)
    spec = {"name": "AMD EPYC", "peak_flops": {"float32": 6e11, "bfloat16": 1.2e12},
            "memory_bandwidth": 1e11}
    cert = {"platform": "cpu", "hardware": {"spec": spec}, "performance": {
        "matmul": {"bfloat16": {"fraction_of_declared": 0.42},
                   "float32": {"fraction_of_declared": 0.2}},
        "memory_bandwidth": {"fraction_of_declared": 0.61}}}
    read = from_certificate(cert)
    assert read.device == "AMD EPYC" and read.efficiency["gemm"] == Efficiency(0.42, 0.61)
    assert read.fitted_to == Peaks("AMD EPYC", spec["peak_flops"], 1e11, "bfloat16")
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


def _doubled(spec: HardwareSpec) -> HardwareSpec:
    return replace(spec, peak_flops={k: 2 * v for k, v in spec.peak_flops.items()},
                   memory_bandwidth=2 * spec.memory_bandwidth)


def test_a_calibration_predicts_what_it_measured_after_the_spec_doubles(tmp_path, caplog):
    """Kernels timed at a fixed achieved throughput, fitted against one spec the way
    `--calibrate` fits them, stored and loaded against a spec with doubled peaks: each op's
    predicted time is still the time measured (the reference), on one device and on a
    shared host's two ranks; without the rescale it would be half of it."""
    from tokenmill.planner.cluster import parse_cluster
    from tokenmill.planner.step import op_seconds, rank_share

    achieved_flops, achieved_bytes = 3e11, 4e10  # what the "machine" does, whatever the spec
    shapes = [(512, 2048, 2048), (512, 1024, 1024), (256, 4096, 1024), (1, 4096, 4096),
              (2, 2048, 4096), (4, 1024, 8192)]
    costs = [gemm(r, k, n, 2, 2) for r, k, n in shapes]
    narrow = Calibration(gemm_width=128).shape_factor  # narrow GEMMs run slower, as modelled
    measured = [max(c.flops / (achieved_flops * narrow(c.inner, c.outer)), c.bytes / achieved_bytes)
                for c in costs]
    for text, ranks in (("1x8xH200", 1), ("1x2xcpu", 2)):
        cluster = parse_cluster(text)
        old = cluster.device
        share = rank_share(cluster, ranks)
        # on a shared host each of n ranks gets 1/n of the machine: it measures 1/n of it too
        points = [point(c, t * share.ranks) for c, t in zip(costs, measured)]
        efficiency = fit_efficiency(points, share.peak, share.bandwidth, 128)
        table = {"per_ranks": {ranks: efficiency}} if cluster.shared_host else {}
        cal = Calibration(device=old.name, efficiency=efficiency, gemm_width=128,
                          fitted_to=Peaks.of(old, "bfloat16"), **table)
        stored = load(save(cal, tmp_path / f"{ranks}.json"))
        new_cluster = replace(cluster, device=_doubled(old))
        new_share = rank_share(new_cluster, ranks)
        with caplog.at_level(logging.INFO, logger="tokenmill.planner.calibration"):
            rescaled = for_spec(stored, new_cluster.device)
        assert "rescaled by 0.5 (compute) and 0.5 (memory)" in caplog.text
        for c, t in zip(costs, measured):
            assert op_seconds(c, share, stored)[0] == pytest.approx(t * share.ranks, rel=1e-9)
            assert op_seconds(c, new_share, rescaled)[0] == pytest.approx(t * share.ranks, rel=1e-9)
            assert op_seconds(c, new_share, stored)[0] == pytest.approx(t * share.ranks / 2,
                                                                        rel=1e-9)
        assert for_spec(stored, old) is stored  # the spec it was fitted to: nothing to do


def test_the_planner_rescales_a_stored_calibration_to_the_clusters_spec():
    """`planner.plan` (what `tokenmill plan` runs) predicts the same TTFT and TPOT from a
    calibration fitted to a spec and a cluster whose spec doubled since."""
    from tokenmill import planner
    from tokenmill.planner.catalog import model_shape
    from tokenmill.planner.cluster import parse_cluster
    from tokenmill.planner.workload import Workload

    cluster = parse_cluster("1x8xH200")
    halved = {op: Efficiency(e.compute / 2, e.memory / 3) for op, e in Calibration().efficiency.items()}
    cal = Calibration(device=cluster.device.name, efficiency=halved,
                      fitted_to=Peaks.of(cluster.device, "bfloat16"))
    model, workload = model_shape("qwen3-32b"), Workload(2000, 200, concurrency=16)
    before = planner.plan(model, cluster, workload, calibration=cal, pool="both").candidates
    after = planner.plan(model, replace(cluster, device=_doubled(cluster.device)), workload,
                         calibration=cal, pool="both").candidates
    assert [c.mix for c in after] == [c.mix for c in before]
    for a, b in zip(after, before):
        assert a.ttft_s == pytest.approx(b.ttft_s, rel=1e-9)
        assert a.tpot_s == pytest.approx(b.tpot_s, rel=1e-9)


def test_a_calibration_without_its_peaks_is_refused_with_what_to_do(tmp_path, capsys):
    """A file of format version 1 (no `fitted_to`) cannot be rescaled: `load` and `tokenmill
    plan --calibration` refuse it, naming the file and the fix."""
    from tokenmill.server.cli import build_parser

    old = to_json(Calibration(device="AMD EPYC (2 cores)", efficiency={"gemm": Efficiency(0.1, 0.2)}))
    del old["fitted_to"]
    old["version"] = 1
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"old\.json.*does not record the HardwareSpec peaks.*"
                                         r"tokenmill plan --calibrate"):
        load(path)
    args = build_parser().parse_args(["plan", "--calibration", str(path), "--cluster", "1x8xH200",
                                      "--workload", "isl=128,osl=8"])
    assert args.func(args) == 2
    assert "does not record the HardwareSpec peaks" in capsys.readouterr().err
    with pytest.raises(ValueError, match="does not record the HardwareSpec peaks"):
        for_spec(Calibration(device="x", efficiency={"gemm": Efficiency(0.1, 0.2)}),
                 parse_spec_of_h200())


def parse_spec_of_h200() -> HardwareSpec:
    from tokenmill.planner.cluster import parse_cluster

    return parse_cluster("1x8xH200").device


def test_calibrations_are_stored_and_found_per_dtype(tmp_path, monkeypatch, caplog):
    """A calibration is stored per device and kernel dtype, and the planner takes the one of
    the model's dtype; with only another dtype's stored, it uses that one and warns naming
    both dtypes and the command that measures the right one (a CPU without native bf16
    runs bf16 GEMMs several times slower than fp32 ones: one dtype's efficiency is wrong
    for the other)."""
    from tokenmill.planner import calibration as cal_io

    monkeypatch.setenv("HOME", str(tmp_path))
    device = "AMD EPYC (2 cores)"
    assert cal_io.default_path(device, "bfloat16").name == "AMD_EPYC__2_cores.bfloat16.json"
    assert cal_io.default_path(device).name == "AMD_EPYC__2_cores.json"
    assert not cal_io.stored(device, "bfloat16").calibrated  # nothing stored: the defaults

    spec = HardwareSpec(name=device, peak_flops={"float32": PEAK, "bfloat16": PEAK},
                        memory_bandwidth=BANDWIDTH, memory_bytes=1 << 34)
    fp32 = Calibration(device=device, efficiency={"gemm": Efficiency(0.5, 0.6)},
                       fitted_to=Peaks.of(spec, "float32"))
    save(fp32, cal_io.default_path(device, "float32"))
    with caplog.at_level(logging.WARNING, logger="tokenmill.planner.calibration"):
        found = cal_io.stored(device, "bfloat16")
    assert found.efficiency["gemm"].compute == 0.5
    assert "measured with float32 kernels" in caplog.text
    assert "--calibrate --dtype bfloat16" in caplog.text

    bf16 = replace(fp32, efficiency={"gemm": Efficiency(0.07, 0.6)},
                   fitted_to=Peaks.of(spec, "bfloat16"))
    save(bf16, cal_io.default_path(device, "bfloat16"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenmill.planner.calibration"):
        assert cal_io.stored(device, "bfloat16").efficiency["gemm"].compute == 0.07
        assert cal_io.stored(device, "float32").efficiency["gemm"].compute == 0.5
    assert caplog.text == ""


def test_kernel_points_are_measured_in_the_asked_dtype():
    """`all_points(dtype=...)` times the kernels in that dtype (bytes per element in their
    costs), not in the platform's default."""
    import torch

    from tokenmill.planner.kernel_bench import gemm_points
    from tokenmill.platforms.registry import load_platform

    active = load_platform("cpu")  # its default dtype is either, by the CPU's flags
    fp32 = gemm_points(active, torch.float32, active.platform.device, quick=True)
    bf16 = gemm_points(active, torch.bfloat16, active.platform.device, quick=True)
    by_name = {p.name: p for p in fp32}
    assert bf16 and all(p.cost.bytes < by_name[p.name].cost.bytes for p in bf16)


def test_overheads_are_fitted_from_decode_steps_at_two_depths():
    from tokenmill.planner.calibrate import overheads_from_steps

    # a model of the steps: 1 ms a step, 0.1 ms a layer; tp2 adds 5 ms a step and 2 ms a
    # layer beyond its all-reduces (0.05 ms each: 2 a layer, 1 more a step)
    step, layer, rank, tp_layer, reduce = 1e-3, 1e-4, 5e-3, 2e-3, 5e-5

    def tp1(layers):
        return step + layer * layers

    def tp2(layers):
        return tp1(layers) + rank + (tp_layer + 2 * reduce) * layers + reduce

    # pp2 runs two stages of 4 layers one after the other, each with a step's costs, a
    # send (0.03 ms) and 4 ms of hand-over (no all-reduce: no rank overhead)
    send, stage = 3e-5, 4e-3
    pp2_eight = 2 * (tp1(4) + send + stage)

    fitted = overheads_from_steps(tp1(2), tp1(8), tp2(2), tp2(8), reduce, rank_default_s=0.0,
                                  pp_eight=pp2_eight, send_latency_s=send)
    assert fitted == pytest.approx({"step_overhead_s": step, "layer_overhead_s": layer,
                                    "rank_overhead_s": rank, "tp_layer_overhead_s": tp_layer,
                                    "pp_stage_overhead_s": stage})
    alone = overheads_from_steps(tp1(2), tp1(8), None, None, reduce, rank_default_s=7e-4)
    assert alone["rank_overhead_s"] == 7e-4 and alone["tp_layer_overhead_s"] == 0.0
    assert alone["pp_stage_overhead_s"] == 0.0


def test_the_tp_layer_overhead_is_paid_per_layer_by_tensor_parallel_mixes_only():
    from tokenmill.planner.catalog import model_shape
    from tokenmill.planner.cluster import parse_cluster
    from tokenmill.planner.mixes import Mix
    from tokenmill.planner.ops import Seq
    from tokenmill.planner.step import step_time

    model, cluster = model_shape("llama-3-70b"), parse_cluster("1x8xH200")
    seqs, extra = (Seq(4096, 1, count=8),), 1e-3
    with_extra = Calibration(tp_layer_overhead_s=extra)
    assert from_json(to_json(with_extra)).tp_layer_overhead_s == extra
    for mix, paid in ((Mix(tp=2), model.num_layers), (Mix(tp=2, pp=2), model.num_layers // 2),
                      (Mix(pp=2), 0), (Mix(), 0)):
        base = step_time(model, mix, cluster, Calibration(), seqs, 8)
        more = step_time(model, mix, cluster, with_extra, seqs, 8)
        assert more.overhead_s - base.overhead_s == pytest.approx(extra * paid), mix


def test_the_pp_stage_overhead_is_paid_once_a_step_by_pipelined_mixes_only():
    from tokenmill.planner.catalog import model_shape
    from tokenmill.planner.cluster import parse_cluster
    from tokenmill.planner.mixes import Mix
    from tokenmill.planner.ops import Seq
    from tokenmill.planner.step import step_time

    model, cluster = model_shape("llama-3-70b"), parse_cluster("1x8xH200")
    seqs, extra = (Seq(4096, 1, count=8),), 2e-3
    with_extra = Calibration(pp_stage_overhead_s=extra)
    assert from_json(to_json(with_extra)).pp_stage_overhead_s == extra
    for mix, paid in ((Mix(pp=2), 1), (Mix(tp=2, pp=2), 1), (Mix(tp=2), 0), (Mix(), 0)):
        base = step_time(model, mix, cluster, Calibration(), seqs, 8)
        more = step_time(model, mix, cluster, with_extra, seqs, 8)
        assert more.overhead_s - base.overhead_s == pytest.approx(extra * paid), mix


def test_layer_extras_come_from_tiny_models_of_each_kind():
    """Steps of 8-layer tiny models, kernels taken off: 1 ms a step, a llama layer 0.1 ms;
    an MoE layer 0.3 ms (0.2 more), a Qwen3-Next layer (Gated DeltaNet + its experts)
    0.45 ms (0.15 beyond the experts' extra), a Mamba2 layer 0.25 ms."""
    from tokenmill.planner.calibrate import layer_extras

    step, layer = 1e-3, 1e-4
    kinds = {"moe": step + 8 * 3e-4, "gated_delta": step + 8 * 4.5e-4, "mamba2": step + 8 * 2.5e-4}
    assert layer_extras(step, layer, kinds, 8) == pytest.approx(
        {"moe": 2e-4, "gated_delta": 1.5e-4, "mamba2": 1.5e-4})


def test_a_layer_pays_the_extra_of_its_kind():
    """Qwen3-Next-80B: 36 Gated DeltaNet and 12 gated attention layers, every one with
    routed experts: each pays the llama layer's overhead and the experts' extra, the
    DeltaNet layers their mixer's too; a dense llama pays none."""
    from tokenmill.planner.catalog import model_shape
    from tokenmill.planner.cluster import parse_cluster
    from tokenmill.planner.mixes import Mix
    from tokenmill.planner.ops import Seq
    from tokenmill.planner.step import step_time

    cluster, seqs = parse_cluster("1x8xH200"), (Seq(4096, 1, count=8),)
    extra = Calibration(layer_overhead_s=1e-4,
                        layer_extra_s={"moe": 2e-4, "gated_delta": 3e-4, "mamba2": 5e-4})
    assert from_json(to_json(extra)).layer_extra_s == extra.layer_extra_s
    base = Calibration(layer_overhead_s=1e-4)
    for name, paid in (("qwen3-next-80b-a3b", 48 * 2e-4 + 36 * 3e-4), ("llama-3-70b", 0.0)):
        model = model_shape(name)
        for mix in (Mix(), Mix(pp=2)):
            more = step_time(model, mix, cluster, extra, seqs, 8).overhead_s
            less = step_time(model, mix, cluster, base, seqs, 8).overhead_s
            # pp2: the slowest stage's half (the stages split the kinds evenly here)
            assert more - less == pytest.approx(paid / mix.pp, rel=1e-6), (name, mix)


def test_the_tiny_model_of_every_layer_kind_decodes_and_its_kernels_are_priced(tmp_path):
    """The calibration's probes run: a 2-layer tiny model of each kind decodes through the
    engine, and the model prices its kernels (their latencies) below its step."""
    from tokenmill.planner.calibrate import tiny_kernels_s
    from tokenmill.planner.engine_probe import KINDS, decode_step_seconds
    from tokenmill.platforms.registry import load_platform

    spec = load_platform("cpu").hardware_spec()
    cal = Calibration(latency={"gemm": 5e-6, "elementwise": 2e-6, "moe": 1e-4})
    for kind in KINDS:
        seconds = decode_step_seconds(tmp_path, "cpu", layers=2, steps=4, kind=kind)
        kernels = tiny_kernels_s(cal, spec, tmp_path, 2, "float32", kind=kind)
        assert 0 < kernels < seconds, kind


def test_the_rank_overhead_is_paid_by_steps_whose_ranks_wait_on_collectives():
    """tp, dcp and pcp steps all-reduce or gather between their ranks each layer: they
    pay the rank overhead once a step; a pipeline's stages hand over instead (pp alone
    pays none of it, pp with tp does)."""
    from tokenmill.planner.catalog import model_shape
    from tokenmill.planner.cluster import parse_cluster
    from tokenmill.planner.mixes import Mix
    from tokenmill.planner.ops import Seq
    from tokenmill.planner.step import step_time

    model, cluster = model_shape("llama-3-70b"), parse_cluster("1x8xH200")
    seqs, extra = (Seq(4096, 1, count=8),), 3e-3
    base, more = Calibration(rank_overhead_s=0.0), Calibration(rank_overhead_s=extra)
    for mix, paid in ((Mix(tp=2), 1), (Mix(dcp=2), 1), (Mix(pcp=2), 1), (Mix(tp=2, pp=2), 1),
                      (Mix(pp=2), 0), (Mix(), 0)):
        got = (step_time(model, mix, cluster, more, seqs, 8).overhead_s
               - step_time(model, mix, cluster, base, seqs, 8).overhead_s)
        assert got == pytest.approx(extra * paid), mix
