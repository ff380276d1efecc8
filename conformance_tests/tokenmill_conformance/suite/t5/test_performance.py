"""T5 performance: matmul FLOP/s, memory bandwidth and attention timings measured on the
platform, checked and recorded as calibration data.

Each measurement is checked twice: its output equals the reference (a fast wrong kernel
measures nothing), and its figure is within the physical limits the plugin declares in
its `HardwareSpec` (above a declared peak, either the spec or the timing is wrong; a 10%
margin covers boost clocks and timer noise). The figures go to the certificate's
`performance` report and, one record per measurement (op, dtype, shape, FLOPs, bytes,
seconds and the fractions of the declared peaks), to its `calibration` section, which the
planner reads (`tokenmill plan --calibrate`; docs/certificate-schema.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill.platforms.ops.reference import paged_attention
from tokenmill_conformance.attention_harness import make_step, to_device
from tokenmill_conformance.errors import Bounds, assert_matches

# A measured figure may exceed the declared peak by this factor at most.
PHYSICAL_MARGIN = 1.10
# matmul results against float64 (K up to 2,048: the accumulation error grows as sqrt(K))
MATMUL_BOUNDS = {
    torch.float32: Bounds(atol=1e-3, rtol=1e-3, rel_rms=1e-5, mean=2e-6, scale=2e-6),
    torch.float16: Bounds(atol=5e-2, rtol=1e-2, rel_rms=2e-3, mean=4e-4, scale=4e-4),
    torch.bfloat16: Bounds(atol=4e-1, rtol=2e-2, rel_rms=1e-2, mean=2e-3, scale=2e-3),
}


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _within(name: str, achieved: float, declared: float | None, unit: str) -> None:
    if declared:
        assert achieved <= declared * PHYSICAL_MARGIN, (
            f"{name}: measured {achieved:.4g} {unit}, above the declared peak {declared:.4g} "
            f"{unit} (x{PHYSICAL_MARGIN} allowed): the HardwareSpec understates the device or "
            "the work did not happen")


def _record(records: list, op: str, dtype: str, shape: str, flops: float, num_bytes: float,
            seconds: float, spec) -> None:
    """One calibration record (docs/certificate-schema.md, `calibration.measurements`)."""
    peak = spec.peak_flops.get(dtype)
    records.append({
        "op": op, "dtype": dtype, "shape": shape, "flops": flops, "bytes": num_bytes,
        "seconds": seconds, "flops_per_s": flops / seconds, "bytes_per_s": num_bytes / seconds,
        "fraction_of_peak_flops": flops / seconds / peak if peak and flops else None,
        "fraction_of_bandwidth": (num_bytes / seconds / spec.memory_bandwidth
                                  if num_bytes else None),
    })


@pytest.fixture(scope="module")
def report(conformance):
    return conformance.performance


@pytest.fixture(scope="module")
def calibration(conformance):
    return conformance.calibration


def test_matmul_flops(active, quick, report, calibration):
    spec = active.hardware_spec()
    device = active.platform.device
    n = 512 if quick else 2048
    results = {}
    for dtype in sorted(active.platform.capabilities.dtypes, key=str):
        name = str(dtype).removeprefix("torch.")
        gen = torch.Generator().manual_seed(5)
        a_cpu, b_cpu = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
        a, b = a_cpu.to(device), b_cpu.to(device)
        seconds = _best_seconds(lambda a=a, b=b: a @ b, device, 3 if quick else 10)
        want = (a_cpu.double() @ b_cpu.double()).to(dtype)
        assert_matches(a @ b, want, op="matmul (T5's measured op)", shape=f"{n}x{n}x{n}",
                       dtype=dtype, bounds=MATMUL_BOUNDS.get(dtype, MATMUL_BOUNDS[torch.float32]))
        achieved = 2 * n**3 / seconds
        declared = spec.peak_flops.get(name)
        results[name] = {
            "n": n,
            "achieved_flops": achieved,
            "declared_flops": declared,
            "fraction_of_declared": achieved / declared if declared else None,
        }
        _within(f"matmul {name} {n}^3", achieved, declared, "FLOP/s")
        elem = a.element_size()
        _record(calibration, "gemm", name, f"{n}x{n}x{n}", 2.0 * n**3, 3.0 * n * n * elem, seconds,
                spec)
    report["matmul"] = results
    assert results


def test_memory_bandwidth(active, quick, report, calibration):
    spec = active.hardware_spec()
    device = active.platform.device
    num_bytes = (256 if quick else 512) << 20  # past any last-level cache
    src = torch.arange(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, 3 if quick else 10)
    assert torch.equal(dst[:: 1 << 16].cpu(), src[:: 1 << 16].cpu()), "the copy did not copy"
    achieved = 2 * num_bytes / seconds  # read + write
    report["memory_bandwidth"] = {
        "bytes_copied": num_bytes,
        "achieved_bytes_per_s": achieved,
        "declared_bytes_per_s": spec.memory_bandwidth,
        "fraction_of_declared": achieved / spec.memory_bandwidth,
    }
    _within("device memory copy", achieved, spec.memory_bandwidth, "bytes/s")
    _record(calibration, "memory_copy", "float32", f"{num_bytes >> 20} MiB", 0.0, 2.0 * num_bytes,
            seconds, spec)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_attention_timing(active, quick, report, calibration, phase):
    caps = active.platform.capabilities
    if AttentionKind.FULL not in caps.attention_kinds:
        pytest.skip("full attention is not declared")
    spec_hw = active.hardware_spec()
    dtype = active.platform.default_dtype
    block = min(caps.block_sizes, key=lambda s: abs(s - 16))
    head = 128 if 128 in caps.head_sizes else max(caps.head_sizes)
    spec = AttentionSpec(AttentionKind.FULL, 16, 4, head, dtype, block)
    context = 256 if quick else 2048
    seqs = [(context, 1)] * 16 if phase == "decode" else [(0, context)]
    step = make_step(seqs, spec)
    want = paged_attention(spec, step.query, step.key, step.value, step.kv_cache.clone(),
                           step.metadata)
    step = to_device(step, active.platform.device)
    backend = active.attention_backend(spec)

    def run() -> torch.Tensor:
        backend.prepare(step.metadata)
        return backend.forward(spec, step.query, step.key, step.value, step.kv_cache,
                               step.metadata)

    seconds = _best_seconds(run, active.platform.device, 2 if quick else 10)
    assert_matches(run(), want, op=f"attention (full) timed by T5 on {backend.name}",
                   shape=f"{len(seqs)} x (cached {seqs[0][0]}, new {seqs[0][1]})", dtype=dtype)
    elem = step.kv_cache.element_size()
    keys = sum(c + n for c, n in seqs)
    kv_bytes = keys * 2 * spec.num_kv_heads * head * elem
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in seqs)
    flops = 4.0 * spec.num_heads * head * pairs  # scores and the weighted values
    name = str(dtype).removeprefix("torch.")
    report.setdefault("attention", {})[phase] = {
        "backend": backend.name,
        "dtype": name,
        "batch": f"{len(seqs)} x (cached {seqs[0][0]}, new {seqs[0][1]})",
        "seconds_per_layer": seconds,
        "kv_bytes_read_per_s": kv_bytes / seconds,
        "flops_per_s": flops / seconds,
    }
    _within(f"attention {phase} KV reads", kv_bytes / seconds, spec_hw.memory_bandwidth,
            "bytes/s")
    _within(f"attention {phase}", flops / seconds, spec_hw.peak_flops.get(name), "FLOP/s")
    _record(calibration, "attention_full", name,
            f"{phase}: {len(seqs)} x (cached {seqs[0][0]}, new {seqs[0][1]}), 16 query / 4 kv "
            f"heads x {head}", flops, float(kv_bytes), seconds, spec_hw)
