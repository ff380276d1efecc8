"""T5 performance report: achieved matmul FLOP/s and memory bandwidth against the plugin's
declared `HardwareSpec`, and attention timings. Reported in the certificate; these tests
fail only when a measurement cannot be taken at all."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill_conformance.attention_harness import make_step, to_device


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


@pytest.fixture(scope="module")
def report(conformance):
    return conformance.performance


def test_matmul_flops(active, quick, report):
    spec = active.hardware_spec()
    device = active.platform.device
    n = 512 if quick else 2048
    results = {}
    for dtype in sorted(active.platform.capabilities.dtypes, key=str):
        name = str(dtype).removeprefix("torch.")
        a = torch.randn(n, n).to(dtype).to(device)
        b = torch.randn(n, n).to(dtype).to(device)
        seconds = _best_seconds(lambda a=a, b=b: a @ b, device, 3 if quick else 10)
        achieved = 2 * n**3 / seconds
        declared = spec.peak_flops.get(name)
        results[name] = {
            "n": n,
            "achieved_flops": achieved,
            "declared_flops": declared,
            "fraction_of_declared": achieved / declared if declared else None,
        }
    report["matmul"] = results
    assert results


def test_memory_bandwidth(active, quick, report):
    spec = active.hardware_spec()
    device = active.platform.device
    num_bytes = (64 if quick else 512) << 20
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, 3 if quick else 10)
    achieved = 2 * num_bytes / seconds  # read + write
    report["memory_bandwidth"] = {
        "bytes_copied": num_bytes,
        "achieved_bytes_per_s": achieved,
        "declared_bytes_per_s": spec.memory_bandwidth,
        "fraction_of_declared": achieved / spec.memory_bandwidth,
    }


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_attention_timing(active, quick, report, phase):
    caps = active.platform.capabilities
    if AttentionKind.FULL not in caps.attention_kinds:
        pytest.skip("full attention is not declared")
    dtype = active.platform.default_dtype
    block = min(caps.block_sizes, key=lambda s: abs(s - 16))
    head = 128 if 128 in caps.head_sizes else max(caps.head_sizes)
    spec = AttentionSpec(AttentionKind.FULL, 16, 4, head, dtype, block)
    context = 256 if quick else 2048
    seqs = [(context, 1)] * 16 if phase == "decode" else [(0, context)]
    step = to_device(make_step(seqs, spec), active.platform.device)
    backend = active.attention_backend(spec)

    def run() -> None:
        backend.prepare(step.metadata)
        backend.forward(spec, step.query, step.key, step.value, step.kv_cache, step.metadata)

    seconds = _best_seconds(run, active.platform.device, 2 if quick else 10)
    kv_bytes = sum(c + n for c, n in seqs) * 2 * spec.num_kv_heads * head * step.kv_cache.element_size()
    report.setdefault("attention", {})[phase] = {
        "backend": backend.name,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": f"{len(seqs)} x (cached {seqs[0][0]}, new {seqs[0][1]})",
        "seconds_per_layer": seconds,
        "kv_bytes_read_per_s": kv_bytes / seconds,
    }
