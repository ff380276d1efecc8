"""Peak figures per TPU generation, and an honest estimate for JAX's CPU backend.

TPU figures are per chip, from Google Cloud's published system architecture pages
(cloud.google.com/tpu/docs/system-architecture-tpu-vm and the per-version pages):
bf16 dense peak, HBM size and bandwidth, and the inter-chip interconnect (ICI) bandwidth
per chip. float32 matmuls run on the MXU as several bf16 passes; the figure below is for
XLA's highest precision (six passes), i.e. bf16 / 6.

On JAX's CPU backend the "devices" forced by
`--xla_force_host_platform_device_count` are slices of one host: peak is cores x clock x
FLOP per cycle (16 fp32 with AVX2 FMA, 32 with AVX-512; XLA computes bf16 by converting
to fp32, so bf16 gets the fp32 figure), memory bandwidth 6 GB/s per usable core (at most
80 GB/s), and the "link" between two such devices is a host memory copy (half the memory
bandwidth: one read and one write).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from tokenmill.platforms.interfaces import HardwareSpec

GB = 1e9
GIB = 1 << 30
_CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True, slots=True)
class TpuGeneration:
    name: str
    device_kinds: tuple[str, ...]  # jax's `device_kind` strings for this generation
    bf16_flops: float
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s per chip


TPU_GENERATIONS = (
    TpuGeneration("TPU v4", ("TPU v4",), 275e12, 32 * GIB, 1228 * GB, 2400e9 / 8),
    TpuGeneration("TPU v5e", ("TPU v5 lite", "TPU v5e"), 197e12, 16 * GIB, 819 * GB, 1600e9 / 8),
    TpuGeneration("TPU v5p", ("TPU v5", "TPU v5p"), 459e12, 95 * GIB, 2765 * GB, 4800e9 / 8),
    TpuGeneration("TPU v6e", ("TPU v6 lite", "TPU v6e"), 918e12, 32 * GIB, 1640 * GB, 3584e9 / 8),
)


def tpu_generation(device_kind: str) -> TpuGeneration:
    """The table row for jax's `device.device_kind`; ValueError naming it when unknown."""
    for generation in TPU_GENERATIONS:
        if device_kind in generation.device_kinds:
            return generation
    known = [k for g in TPU_GENERATIONS for k in g.device_kinds]
    raise ValueError(f"unknown TPU device kind {device_kind!r}; the table knows {known}")


def tpu_spec(device_kind: str) -> HardwareSpec:
    g = tpu_generation(device_kind)
    return HardwareSpec(
        name=g.name,
        peak_flops={"bfloat16": g.bf16_flops, "float32": g.bf16_flops / 6},
        memory_bandwidth=g.hbm_bandwidth,
        memory_bytes=g.hbm_bytes,
        link_bandwidth=g.ici_bandwidth,
    )


def named_spec(device: str) -> HardwareSpec | None:
    """The published spec of the TPU generation named `device` ("TPU v5e", "v5e",
    "tpu-v5e", or one of jax's device kinds), for the planner; None when unknown."""
    def key(text: str) -> str:
        return text.lower().replace(" ", "").replace("-", "").replace("_", "").removeprefix("tpu")

    wanted = key(device)
    for generation in TPU_GENERATIONS:
        if wanted in {key(generation.name), *(key(k) for k in generation.device_kinds)}:
            return tpu_spec(generation.device_kinds[0])
    return None


def _cpu_flags() -> frozenset[str]:
    if not _CPUINFO.exists():
        return frozenset()
    for line in _CPUINFO.read_text().splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def jax_cpu_spec(num_devices: int) -> HardwareSpec:
    """The whole host as JAX's CPU backend sees it, split into `num_devices` devices."""
    cores = usable_cores()
    freq = psutil.cpu_freq()
    clock = freq.max * 1e6 if freq is not None and freq.max > 0 else 2.0e9
    per_cycle = 32 if "avx512f" in _cpu_flags() else 16
    peak = cores * clock * per_cycle
    bandwidth = min(cores * 6 * GB, 80 * GB)
    return HardwareSpec(
        name=f"JAX on CPU ({cores} cores as {num_devices} device(s)), not a TPU",
        peak_flops={"float32": peak, "bfloat16": peak},
        memory_bandwidth=bandwidth,
        memory_bytes=psutil.virtual_memory().total,
        link_bandwidth=bandwidth / 2 if num_devices > 1 else 0.0,
    )
