"""Efficiency factors: the fraction of a device's peak each op class reaches, the cost of
a step beyond its kernels, and the collectives' latency and bandwidth.

The performance model times an op as max(FLOPs / (peak x compute efficiency), bytes /
(bandwidth x memory efficiency)). Uncalibrated, it uses `DEFAULTS` (typical fractions of
peak of tuned kernels on a GPU); `tokenmill plan --calibrate` measures them on the machine
at hand through the active plugin (tokenmill/planner/calibrate.py) and stores them as JSON
(`save` / `load`), and a conformance certificate whose T5 report holds calibration data
is read the same way (`from_certificate`).

On a shared host (the cpu plugin: every rank of a mix is a process on the same cores),
efficiencies are measured per number of ranks sharing it (`per_ranks`): two processes
time-slicing two cores do not reach what one process does.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

FORMAT = "tokenmill-calibration"
VERSION = 1


@dataclass(frozen=True, slots=True)
class Efficiency:
    compute: float  # achieved / peak FLOP/s when compute bound
    memory: float  # achieved / peak bytes/s when memory bound


@dataclass(frozen=True, slots=True)
class LinkFit:
    """A collective's time on n ranks: steps x latency + (n - 1) / n x volume / bandwidth."""

    latency: float
    bandwidth: float


DEFAULTS: dict[str, Efficiency] = {
    "gemm": Efficiency(0.7, 0.8),
    "moe": Efficiency(0.55, 0.7),
    "attention_full": Efficiency(0.5, 0.7),
    "attention_sliding": Efficiency(0.5, 0.7),
    "attention_mla": Efficiency(0.45, 0.7),
    "recurrent_gated_delta": Efficiency(0.3, 0.5),
    "recurrent_kda": Efficiency(0.3, 0.5),
    "recurrent_mamba2": Efficiency(0.3, 0.5),
    "elementwise": Efficiency(0.3, 0.6),
}
DEFAULT_LINK_EFFICIENCY = 0.8  # of a link's bandwidth a collective reaches (bus bandwidth)
# A GEMM whose reduced dim k or output width n is narrow keeps fewer tiles in flight and
# pipelines fewer k steps: its efficiency is scaled by s(k) s(n), s(x) = x / (x + W)
# relative to s(4096); W is a tile width (128 on GPUs; `--calibrate` fits it).
DEFAULT_GEMM_WIDTH = 128
_REFERENCE_WIDTH = 4096


@dataclass(frozen=True)
class Calibration:
    device: str = "uncalibrated"  # the HardwareSpec name it was measured against
    platform: str = ""
    efficiency: dict[str, Efficiency] = field(default_factory=lambda: dict(DEFAULTS))
    # shared host: ranks sharing it -> op class -> efficiency of one rank's share of peak
    per_ranks: dict[int, dict[str, Efficiency]] = field(default_factory=dict)
    # op ("all_reduce", "all_gather", "send" ...) -> fit, and ranks -> op -> fit
    collectives: dict[int, dict[str, LinkFit]] = field(default_factory=dict)
    link_efficiency: float = DEFAULT_LINK_EFFICIENCY
    gemm_width: float = DEFAULT_GEMM_WIDTH
    step_overhead_s: float = 1e-3  # host time of an engine step beyond its kernels
    layer_overhead_s: float = 0.0  # per layer of a step (kernel launches, Python)
    rank_overhead_s: float = 2e-4  # per step, when the ranks are processes of their own
    measured: dict = field(default_factory=dict)  # the raw measurements, for the record
    created: float = 0.0

    @property
    def calibrated(self) -> bool:
        return self.device != "uncalibrated"

    def efficiency_for(self, op: str, ranks: int = 1) -> Efficiency:
        table = self.per_ranks.get(_nearest(self.per_ranks, ranks), self.efficiency)
        return table.get(op) or self.efficiency.get(op) or DEFAULTS.get(op) or DEFAULTS["gemm"]

    def shape_factor(self, inner: int, outer: int) -> float:
        """The efficiency scale of a GEMM of reduced dim `inner` and width `outer` (1 for
        a GEMM as wide as 4096 and for an op that is no GEMM)."""
        if not inner:
            return 1.0
        w = self.gemm_width
        ref = _REFERENCE_WIDTH / (_REFERENCE_WIDTH + w)
        return min(1.0, inner / (inner + w) / ref) * min(1.0, outer / (outer + w) / ref)

    def collective_fit(self, op: str, ranks: int) -> LinkFit | None:
        if not self.collectives:
            return None
        fits = self.collectives[_nearest(self.collectives, ranks)]
        return fits.get(op) or fits.get("all_reduce")


_UNCALIBRATED = Calibration()


def _nearest(table: dict[int, object], ranks: int) -> int:
    if not table:
        return ranks
    return min(table, key=lambda n: (abs(n - ranks), n))


def to_json(cal: Calibration) -> dict:
    data = asdict(cal)
    data["format"], data["version"] = FORMAT, VERSION
    return data


def from_json(data: dict) -> Calibration:
    if data.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} file (format {data.get('format')!r})")

    def table(entries: dict) -> dict[str, Efficiency]:
        return {op: Efficiency(**e) for op, e in entries.items()}

    return Calibration(
        device=data["device"],
        platform=data.get("platform", ""),
        efficiency=table(data["efficiency"]),
        per_ranks={int(n): table(t) for n, t in data.get("per_ranks", {}).items()},
        collectives={int(n): {op: LinkFit(**f) for op, f in fits.items()}
                     for n, fits in data.get("collectives", {}).items()},
        link_efficiency=data.get("link_efficiency", DEFAULT_LINK_EFFICIENCY),
        gemm_width=data.get("gemm_width", DEFAULT_GEMM_WIDTH),
        # a conformance certificate measures no host overheads: the defaults stand
        step_overhead_s=data.get("step_overhead_s", _UNCALIBRATED.step_overhead_s),
        layer_overhead_s=data.get("layer_overhead_s", _UNCALIBRATED.layer_overhead_s),
        rank_overhead_s=data.get("rank_overhead_s", _UNCALIBRATED.rank_overhead_s),
        measured=data.get("measured", {}),
        created=data.get("created", 0.0),
    )


def save(cal: Calibration, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(replace(cal, created=cal.created or time.time())), indent=1))
    return path


def load(path: Path) -> Calibration:
    """A calibration file, or a conformance certificate carrying one (`calibration` key)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        return from_certificate(data, str(path))
    return from_json(data)


def from_certificate(cert: dict, source: str = "certificate") -> Calibration:
    """The calibration a conformance certificate carries: the T5 report's `calibration`
    (this module's format), else its matmul and memory-bandwidth fractions of the declared
    peak as the GEMM and elementwise efficiencies."""
    perf = cert.get("performance") or {}
    embedded = perf.get("calibration") or cert.get("calibration")
    if embedded:
        return from_json(embedded)
    matmul = perf.get("matmul") or {}
    fractions = [m["fraction_of_declared"] for m in matmul.values() if m.get("fraction_of_declared")]
    bandwidth = (perf.get("memory_bandwidth") or {}).get("fraction_of_declared")
    if not fractions or not bandwidth:
        raise ValueError(f"{source}: neither a calibration file nor a certificate with a T5 "
                         "report (performance.matmul, performance.memory_bandwidth)")
    spec = (cert.get("hardware") or {}).get("spec") or {}
    compute = max(fractions)
    efficiency = dict(DEFAULTS)
    efficiency["gemm"] = Efficiency(compute, bandwidth)
    efficiency["moe"] = Efficiency(compute * 0.8, bandwidth)
    efficiency["elementwise"] = Efficiency(compute * 0.5, bandwidth)
    return Calibration(device=spec.get("name", source), platform=cert.get("platform", ""),
                       efficiency=efficiency, measured={"certificate": source})


def default_path(device: str) -> Path:
    """Where `--calibrate` stores the calibration of `device` (a HardwareSpec name)."""
    safe = "".join(ch if ch.isalnum() else "_" for ch in device).strip("_")[:80]
    return Path.home() / ".cache" / "tokenmill" / "calibration" / f"{safe}.json"
