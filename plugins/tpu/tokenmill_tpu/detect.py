"""The cheap probe: is there a TPU, or was JAX's CPU backend asked for explicitly?

Nothing heavy is imported here (no jax, no libtpu): a TPU is recognised by its driver's
device files (`/dev/accel*` on TPU v2-v4 hosts, `/dev/vfio/*` on v5e and later) or by an
installed `libtpu` package, found by `importlib.util.find_spec` without importing it.
JAX's CPU backend is never picked up by accident: it is available only when the user
sets `JAX_PLATFORMS=cpu` (with `XLA_FLAGS=--xla_force_host_platform_device_count=N` for
N devices), which is how the plugin is certified without a TPU.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from dataclasses import dataclass

JAX_PLATFORMS_ENV = "JAX_PLATFORMS"
XLA_FLAGS_ENV = "XLA_FLAGS"
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


@dataclass(frozen=True, slots=True)
class Probe:
    """What the probe found: the backend JAX should use ("tpu", "cpu" or None) and why."""

    backend: str | None
    reason: str


def requested_platforms() -> list[str]:
    """The platforms `$JAX_PLATFORMS` names, lowercased, in order ([] when unset)."""
    text = os.environ.get(JAX_PLATFORMS_ENV, "")
    return [p.strip().lower() for p in text.split(",") if p.strip()]


def forced_cpu_device_count() -> int:
    """The CPU device count `$XLA_FLAGS` forces (1 when it forces none)."""
    match = _DEVICE_COUNT_FLAG.search(os.environ.get(XLA_FLAGS_ENV, ""))
    return int(match.group(1)) if match else 1


def tpu_device_files() -> list[str]:
    """The TPU driver's device nodes on this host (accel for v2-v4, vfio for v5e and later)."""
    return sorted(glob.glob("/dev/accel*")) + sorted(
        p for p in glob.glob("/dev/vfio/*") if os.path.basename(p) != "vfio"
    )


def probe() -> Probe:
    """The backend to run on: an explicit `JAX_PLATFORMS=cpu` wins; else a TPU if the host
    has one (device files, or libtpu installed); else none, saying what was looked for."""
    requested = requested_platforms()
    if requested and requested[0] == "cpu":
        count = forced_cpu_device_count()
        return Probe(
            "cpu",
            f"JAX's CPU backend, requested by {JAX_PLATFORMS_ENV}=cpu, with {count} device(s)"
            f"{'' if count > 1 else f' (set {XLA_FLAGS_ENV}=--xla_force_host_platform_device_count=4 for four)'}"
            "; not a TPU",
        )
    if requested and "tpu" not in requested:
        return Probe(None, f"{JAX_PLATFORMS_ENV}={os.environ[JAX_PLATFORMS_ENV]!r} names no tpu or cpu")
    files = tpu_device_files()
    has_libtpu = importlib.util.find_spec("libtpu") is not None
    if files and has_libtpu:
        return Probe("tpu", f"TPU device files {files[:4]} and libtpu installed")
    if files:
        return Probe(None, f"TPU device files {files[:4]} found but libtpu is not installed; "
                           "pip install 'tokenmill-tpu[tpu]'")
    return Probe(
        None,
        "no TPU: no /dev/accel* or /dev/vfio/* device files"
        + ("" if has_libtpu else " and libtpu is not installed")
        + f"; set {JAX_PLATFORMS_ENV}=cpu to run on JAX's CPU backend",
    )
