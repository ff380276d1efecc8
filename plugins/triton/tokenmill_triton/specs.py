"""Hardware specs from a table of known parts, shared by the GPU plugins: each plugin keeps
its own table (its vendor's datasheets) and its estimate for parts it does not know."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.platforms.interfaces import HardwareSpec

logger = logging.getLogger(__name__)
T = 1e12
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Part:
    match: str  # case-insensitive substring of the device name; tables list longest first
    bf16: float  # dense FLOP/s (fp16 is the same)
    tf32: float
    fp32: float
    bandwidth: float  # memory bytes/s
    link: float  # device-to-device bytes/s per direction; 0 when unknown
    memory_bytes: int = 0  # the datasheet's capacity (its "GB" are GiB); 0 when unknown


def known_part(parts: Sequence[Part], name: str) -> Part | None:
    return next((p for p in parts if p.match.lower() in name.lower()), None)


def table_spec(parts: Sequence[Part], device: str, vendor: str) -> HardwareSpec | None:
    """The datasheet spec of the part named `device` (case-insensitive: an exact match of
    a row first, else the first row whose name `device` contains), for a planner asking
    about hardware that is not here; None when the table has no such part."""
    wanted = device.strip().lower()
    part = next((p for p in parts if p.match.lower() == wanted), None) or known_part(parts, wanted)
    if part is None:
        return None
    return HardwareSpec(
        name=f"{vendor} {part.match} (datasheet)",
        peak_flops={"bfloat16": part.bf16, "float16": part.bf16, "tf32": part.tf32,
                    "float32": part.fp32},
        memory_bandwidth=part.bandwidth,
        memory_bytes=part.memory_bytes,
        link_bandwidth=part.link,
    )


def spec_from_table(
    parts: Sequence[Part],
    name: str,
    label: str,
    memory_bytes: int,
    estimate_bf16: float,
    env_prefix: str,
) -> HardwareSpec:
    """The spec of device `name` (shown as `label`) from `parts`; an unknown part gets
    `estimate_bf16` FLOP/s and 1 TB/s, marked "(estimated)". `$<env_prefix>_PEAK_TFLOPS_BF16`
    and `$<env_prefix>_MEMORY_BANDWIDTH_GBS` override either."""
    peak_env, bandwidth_env = f"{env_prefix}_PEAK_TFLOPS_BF16", f"{env_prefix}_MEMORY_BANDWIDTH_GBS"
    part = known_part(parts, name)
    if part is None:
        part = Part(name, estimate_bf16, estimate_bf16 / 2, estimate_bf16 / 16, 1.0e12, 0.0)
        label += " (estimated)"
        logger.warning("unknown part %r: peak FLOP/s and bandwidth are estimates; set $%s and "
                       "$%s", name, peak_env, bandwidth_env)
    bf16 = _override(peak_env, T) or part.bf16
    return HardwareSpec(
        name=label,
        peak_flops={"bfloat16": bf16, "float16": bf16, "tf32": part.tf32, "float32": part.fp32},
        memory_bandwidth=_override(bandwidth_env, 1e9) or part.bandwidth,
        memory_bytes=memory_bytes,
        link_bandwidth=part.link,
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
