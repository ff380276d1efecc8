"""What this CPU can do at best: an estimate from core count and vector ISA, no benchmark.

peak FLOP/s = usable cores x clock x FLOP per cycle per core, with conservative FLOP per
cycle (one FMA unit): AVX-512 32 fp32, AVX2 16, otherwise 8; bf16 doubles fp32 with
AVX512-BF16 and is 16x fp32 with AMX; without either it equals fp32 (converted in
software). The clock is psutil's maximum frequency, else 2 GHz. Memory bandwidth is
6 GB/s per usable core, at most 80 GB/s. Override any estimate with
`$TOKENMILL_CPU_PEAK_GFLOPS_FP32`, `$TOKENMILL_CPU_PEAK_GFLOPS_BF16` and
`$TOKENMILL_CPU_MEMORY_BANDWIDTH_GBS`.
"""

from __future__ import annotations

import os
import platform as host
from pathlib import Path

import psutil
import torch

from tokenmill.platforms.interfaces import HardwareSpec

PEAK_FP32_ENV = "TOKENMILL_CPU_PEAK_GFLOPS_FP32"
PEAK_BF16_ENV = "TOKENMILL_CPU_PEAK_GFLOPS_BF16"
BANDWIDTH_ENV = "TOKENMILL_CPU_MEMORY_BANDWIDTH_GBS"
_CPUINFO = Path("/proc/cpuinfo")
_DEFAULT_CLOCK_HZ = 2.0e9
_BANDWIDTH_PER_CORE = 6e9
_MAX_BANDWIDTH = 80e9


def cpu_flags() -> frozenset[str]:
    """The ISA flags of the first CPU in /proc/cpuinfo; empty where there is none."""
    if not _CPUINFO.exists():
        return frozenset()
    for line in _CPUINFO.read_text().splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_native_bf16(flags: frozenset[str]) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def usable_cores() -> int:
    """CPUs this process may run on (affinity / container aware where the OS says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_name() -> str:
    if _CPUINFO.exists():
        for line in _CPUINFO.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return host.processor() or host.machine() or "cpu"


def estimate_hardware_spec() -> HardwareSpec:
    """This machine's `HardwareSpec` from the estimates above and the env overrides."""
    flags = cpu_flags()
    cores = usable_cores()
    freq = psutil.cpu_freq()
    clock = freq.max * 1e6 if freq is not None and freq.max > 0 else _DEFAULT_CLOCK_HZ
    capability = torch.backends.cpu.get_cpu_capability()
    per_cycle = (
        32 if "avx512f" in flags or capability == "AVX512" else 16 if capability == "AVX2" else 8
    )
    fp32 = cores * clock * per_cycle
    bf16 = fp32 * (16 if "amx_bf16" in flags else 2 if "avx512_bf16" in flags else 1)
    bandwidth = min(cores * _BANDWIDTH_PER_CORE, _MAX_BANDWIDTH)
    return HardwareSpec(
        name=f"{cpu_name()} ({cores} cores)",
        peak_flops={
            "float32": _override(PEAK_FP32_ENV, 1e9) or fp32,
            "bfloat16": _override(PEAK_BF16_ENV, 1e9) or bf16,
        },
        memory_bandwidth=_override(BANDWIDTH_ENV, 1e9) or bandwidth,
        memory_bytes=psutil.virtual_memory().total,
    )


def _override(name: str, unit: float) -> float | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"${name}={text!r} must be a positive number")
    return value * unit
