"""What this CPU can do at best: an upper bound from core count and vector ISA, no benchmark.

The figures are ceilings, not typical speeds: tier T5 of the conformance suite fails a
measurement above them (a spec that understates the device hides a timing bug), and the
planner's calibration scales them by measured efficiencies. peak FLOP/s = usable cores x
clock x FLOP per cycle per core, with two FMA pipes of the widest vector the ISA has
(AVX-512 64 fp32 FLOP per cycle, AVX2 32, otherwise 32: Arm cores run four 128-bit pipes);
bf16 is 2x fp32 with AVX512-BF16, 4x with Arm's BF16 matrix instructions, 32x with AMX,
and equals fp32 otherwise (converted in software). The clock is the highest the OS reports
and at least 5 GHz: VMs and containers often report none, or a base clock below the boost
clock. Memory bandwidth is 50 GB/s per usable core (more than one core's outstanding
misses sustain), at most 1.2 TB/s (two sockets of 12 DDR5-6400 channels). Override any
estimate with `$TOKENMILL_CPU_PEAK_GFLOPS_FP32`, `$TOKENMILL_CPU_PEAK_GFLOPS_BF16` and
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
_MIN_CLOCK_HZ = 5.0e9
_BANDWIDTH_PER_CORE = 50e9
_MAX_BANDWIDTH = 1.2e12


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
    """This machine's `HardwareSpec` from the ceilings above and the env overrides."""
    flags = cpu_flags()
    cores = usable_cores()
    freq = psutil.cpu_freq()
    reported = max(freq.max, freq.current) * 1e6 if freq is not None else 0.0
    clock = max(reported, _MIN_CLOCK_HZ)
    capability = torch.backends.cpu.get_cpu_capability()
    per_cycle = 64 if "avx512f" in flags or capability == "AVX512" else 32
    fp32 = cores * clock * per_cycle
    bf16 = fp32 * bf16_speedup(flags)
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


def bf16_speedup(flags: frozenset[str]) -> int:
    """bf16 FLOP per cycle over fp32's at best: AMX tiles, AVX512-BF16 pair dot products,
    Arm's BFMMLA (flag `bf16`); 1 without native bf16."""
    if "amx_bf16" in flags:
        return 32
    if "bf16" in flags:
        return 4
    return 2 if "avx512_bf16" in flags else 1


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
