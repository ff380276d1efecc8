"""Efficiency factors: the fraction of a device's peak each op class reaches, the cost of
a step beyond its kernels, and the collectives' latency and bandwidth.

The performance model times an op as max(FLOPs / (peak x compute efficiency), bytes /
(bandwidth x memory efficiency)) + its calls x the op class's `latency` (the fixed cost of
a call however small its work: dispatch, threads waking, a kernel launch; measured on a
tiny instance of each op class, 0 where not measured). At a large model's shapes the
first term rules; at a small one's decode, the second. Uncalibrated, it uses `DEFAULTS` (typical fractions of
peak of tuned kernels on a GPU); `tokenmill plan --calibrate` measures them on the machine
at hand through the active plugin (tokenmill/planner/calibrate.py) and stores them as JSON
(`save` / `load`), and a conformance certificate whose T5 report holds calibration data
is read the same way (`from_certificate`).

On a shared host (the cpu plugin: every rank of a mix is a process on the same cores),
efficiencies are measured per number of ranks sharing it (`per_ranks`): two processes
time-slicing two cores do not reach what one process does.

An efficiency is a fraction of the peaks of the `HardwareSpec` it was fitted against, so a
calibration records those peaks (`fitted_to`). What was measured is the achieved
throughput, efficiency x the old peak; when the plugin's spec changes later, `for_spec`
rescales each efficiency to the new peaks (logged), so the predicted times stay those
measured. A calibration file without the peaks (format version 1) is refused with an
error saying to run `tokenmill plan --calibrate` again: its efficiencies are fractions of
a spec nobody can name any more, and a plugin's spec did change under one (the cpu
plugin's became a ceiling 5-8x the earlier estimate), predicting 3-4x too fast.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tokenmill.platforms.interfaces import HardwareSpec

logger = logging.getLogger(__name__)

FORMAT = "tokenmill-calibration"
VERSION = 2  # 2: `fitted_to`, the peaks the efficiencies are fractions of


@dataclass(frozen=True, slots=True)
class Efficiency:
    compute: float  # achieved / peak FLOP/s when compute bound
    memory: float  # achieved / peak bytes/s when memory bound


@dataclass(frozen=True, slots=True)
class LinkFit:
    """A collective's time on n ranks: steps x latency + (n - 1) / n x volume / bandwidth."""

    latency: float
    bandwidth: float


@dataclass(frozen=True, slots=True)
class Peaks:
    """The `HardwareSpec` figures a calibration's efficiencies are fractions of: compute
    efficiencies of `peak_flops[dtype]` (the dtype its kernels ran in), memory ones of
    `memory_bandwidth`."""

    device: str  # the spec's name
    peak_flops: dict[str, float]  # dtype name -> FLOP/s
    memory_bandwidth: float  # bytes/s
    dtype: str

    @classmethod
    def of(cls, spec: HardwareSpec, dtype: str) -> Peaks:
        return cls(spec.name, dict(spec.peak_flops), spec.memory_bandwidth, dtype)

    @property
    def flops(self) -> float:
        return peak_at(self.peak_flops, self.dtype)


def peak_at(peak_flops: Mapping[str, float], dtype: str) -> float:
    """The peak FLOP/s of `dtype`, else the highest the spec gives (as the model costs it)."""
    return peak_flops.get(dtype) or max(peak_flops.values())


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
    # op class -> seconds a call costs beyond its roofline time (measured at tiny shapes)
    latency: dict[str, float] = field(default_factory=dict)
    # op ("all_reduce", "all_gather", "send" ...) -> fit, and ranks -> op -> fit
    collectives: dict[int, dict[str, LinkFit]] = field(default_factory=dict)
    link_efficiency: float = DEFAULT_LINK_EFFICIENCY
    gemm_width: float = DEFAULT_GEMM_WIDTH
    step_overhead_s: float = 1e-3  # host time of an engine step beyond its kernels
    layer_overhead_s: float = 0.0  # per layer of a step (kernel launches, Python)
    # per layer of a kind, beyond a llama layer's host time: "moe" (routed experts instead
    # of an MLP) and a token mixer's kind ("gated_delta", "mamba2"), measured on tiny models
    layer_extra_s: dict[str, float] = field(default_factory=dict)
    # per step whose ranks (processes of their own) wait on each other in collectives:
    # tp, dcp, pcp > 1 (a pipeline's stages pay pp_stage_overhead_s instead)
    rank_overhead_s: float = 2e-4
    # per layer of a step when tp > 1: what the ranks' all-reduces cost beyond the
    # collective fit, measured in decode steps (on a shared host, ranks waking each other)
    tp_layer_overhead_s: float = 0.0
    # per stage of a step when pp > 1: the hand-over between stages beyond the send's
    # fitted time (the next rank waking, the engine waiting on the last stage's sample)
    pp_stage_overhead_s: float = 0.0
    measured: dict = field(default_factory=dict)  # the raw measurements, for the record
    created: float = 0.0
    fitted_to: Peaks | None = None  # the spec figures the efficiencies are fractions of

    @property
    def calibrated(self) -> bool:
        return self.device != "uncalibrated"

    def efficiency_for(self, op: str, ranks: int = 1) -> Efficiency:
        table = self.per_ranks.get(_nearest(self.per_ranks, ranks), self.efficiency)
        return table.get(op) or self.efficiency.get(op) or DEFAULTS.get(op) or DEFAULTS["gemm"]

    def latency_for(self, op: str) -> float:
        return self.latency.get(op, 0.0)

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


def for_spec(cal: Calibration, spec: HardwareSpec) -> Calibration:
    """`cal` with its efficiencies as fractions of `spec`'s peaks: each rescaled by old peak
    / new peak, so efficiency x peak, the throughput that was measured, stays the same
    (logged when it changes anything). Uncalibrated defaults are fractions of any spec
    and stay as they are; a calibration of another device (its `fitted_to` names another
    spec) is applied as fractions of this one's peaks, and says so."""
    old = cal.fitted_to
    if old is None:
        if cal.calibrated:
            raise ValueError(_no_peaks(cal.device, "this calibration"))
        return cal
    if old.device != spec.name:
        logger.warning("calibration of %r applied to %r: its efficiencies are used as fractions "
                       "of %r's peaks (measured on another device; `tokenmill plan --calibrate` "
                       "on this one measures it)", old.device, spec.name, spec.name)
        return cal
    compute = old.flops / peak_at(spec.peak_flops, old.dtype)
    memory = old.memory_bandwidth / spec.memory_bandwidth
    if compute == 1.0 and memory == 1.0:
        return cal

    def scaled(table: dict[str, Efficiency]) -> dict[str, Efficiency]:
        return {op: Efficiency(e.compute * compute, e.memory * memory) for op, e in table.items()}

    logger.info("calibration of %r was fitted to peaks of %.4g FLOP/s (%s) and %.4g B/s; the "
                "spec now says %.4g and %.4g: efficiencies rescaled by %.4g (compute) and %.4g "
                "(memory) so the measured throughputs stand", spec.name, old.flops, old.dtype,
                old.memory_bandwidth, peak_at(spec.peak_flops, old.dtype),
                spec.memory_bandwidth, compute, memory)
    out = replace(cal, efficiency=scaled(cal.efficiency),
                  per_ranks={n: scaled(t) for n, t in cal.per_ranks.items()},
                  fitted_to=Peaks.of(spec, old.dtype))
    above = sorted(op for op, e in out.efficiency.items() if max(e.compute, e.memory) > 1.0)
    if above:
        logger.warning("calibration of %r: %s measured faster than the spec's peaks allow (the "
                       "spec understates the device)", spec.name, ", ".join(above))
    return out


def _no_peaks(device: str, source: str) -> str:
    return (f"{source} (device {device!r}) does not record the HardwareSpec peaks its "
            f"efficiencies were fitted against (a calibration of format version 1): they "
            "cannot be rescaled to the plugin's spec, which may have changed since; run "
            "`tokenmill plan --calibrate` again to measure this machine (or plan without "
            "--calibration)")


def _nearest(table: dict[int, object], ranks: int) -> int:
    if not table:
        return ranks
    return min(table, key=lambda n: (abs(n - ranks), n))


def to_json(cal: Calibration) -> dict:
    data = asdict(cal)
    data["format"], data["version"] = FORMAT, VERSION
    return data


def from_json(data: dict, source: str = "calibration") -> Calibration:
    """A calibration from its JSON; raises ValueError (naming `source`) for data of another
    format or a calibration that does not record the peaks it was fitted against."""
    if data.get("format") != FORMAT:
        raise ValueError(f"{source}: not a {FORMAT} file (format {data.get('format')!r})")

    def table(entries: dict) -> dict[str, Efficiency]:
        return {op: Efficiency(**e) for op, e in entries.items()}

    fitted_to = _peaks(data)
    if fitted_to is None and data["device"] != _UNCALIBRATED.device:
        raise ValueError(_no_peaks(data["device"], source))
    return Calibration(
        device=data["device"],
        platform=data.get("platform", ""),
        efficiency=table(data["efficiency"]),
        per_ranks={int(n): table(t) for n, t in data.get("per_ranks", {}).items()},
        latency={op: float(t) for op, t in data.get("latency", {}).items()},
        collectives={int(n): {op: LinkFit(**f) for op, f in fits.items()}
                     for n, fits in data.get("collectives", {}).items()},
        link_efficiency=data.get("link_efficiency", DEFAULT_LINK_EFFICIENCY),
        gemm_width=data.get("gemm_width", DEFAULT_GEMM_WIDTH),
        # a conformance certificate measures no host overheads: the defaults stand
        step_overhead_s=data.get("step_overhead_s", _UNCALIBRATED.step_overhead_s),
        layer_overhead_s=data.get("layer_overhead_s", _UNCALIBRATED.layer_overhead_s),
        layer_extra_s={k: float(v) for k, v in data.get("layer_extra_s", {}).items()},
        rank_overhead_s=data.get("rank_overhead_s", _UNCALIBRATED.rank_overhead_s),
        tp_layer_overhead_s=data.get("tp_layer_overhead_s", _UNCALIBRATED.tp_layer_overhead_s),
        pp_stage_overhead_s=data.get("pp_stage_overhead_s", _UNCALIBRATED.pp_stage_overhead_s),
        measured=data.get("measured", {}),
        created=data.get("created", 0.0),
        fitted_to=fitted_to,
    )


def _peaks(data: dict) -> Peaks | None:
    """`fitted_to`, else the declared spec a conformance certificate's T5 calibration
    records (`measured.declared`; its fractions are of the bfloat16 peak where the spec
    has one)."""
    if data.get("fitted_to"):
        return Peaks(**data["fitted_to"])
    declared = (data.get("measured") or {}).get("declared") or {}
    if declared.get("peak_flops") and declared.get("memory_bandwidth"):
        return Peaks(data["device"], dict(declared["peak_flops"]), declared["memory_bandwidth"],
                     "bfloat16")
    return None


def save(cal: Calibration, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(replace(cal, created=cal.created or time.time())), indent=1))
    return path


def load(path: Path) -> Calibration:
    """A calibration file, or a conformance certificate carrying one (`calibration` key)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        return from_certificate(data, str(path))
    return from_json(data, str(path))


def from_certificate(cert: dict, source: str = "certificate") -> Calibration:
    """The calibration a conformance certificate carries: the T5 report's `calibration`
    (this module's format), else its matmul and memory-bandwidth fractions of the declared
    peak as the GEMM and elementwise efficiencies."""
    perf = cert.get("performance") or {}
    embedded = perf.get("calibration") or cert.get("calibration")
    if embedded:
        return from_json(embedded, source)
    matmul = {dtype: m["fraction_of_declared"] for dtype, m in (perf.get("matmul") or {}).items()
              if m.get("fraction_of_declared")}
    bandwidth = (perf.get("memory_bandwidth") or {}).get("fraction_of_declared")
    if not matmul or not bandwidth:
        raise ValueError(f"{source}: neither a calibration file nor a certificate with a T5 "
                         "report (performance.matmul, performance.memory_bandwidth)")
    spec = (cert.get("hardware") or {}).get("spec") or {}
    if not spec.get("peak_flops") or not spec.get("memory_bandwidth"):
        raise ValueError(_no_peaks(spec.get("name", source), f"{source}: the certificate"))
    dtype = max(matmul, key=matmul.__getitem__)  # the fraction taken is of this dtype's peak
    compute = matmul[dtype]
    fitted_to = Peaks(spec.get("name", source), dict(spec["peak_flops"]),
                      spec["memory_bandwidth"], dtype)
    efficiency = dict(DEFAULTS)
    efficiency["gemm"] = Efficiency(compute, bandwidth)
    efficiency["moe"] = Efficiency(compute * 0.8, bandwidth)
    efficiency["elementwise"] = Efficiency(compute * 0.5, bandwidth)
    return Calibration(device=spec.get("name", source), platform=cert.get("platform", ""),
                       efficiency=efficiency, measured={"certificate": source},
                       fitted_to=fitted_to)


def default_path(device: str, dtype: str | None = None) -> Path:
    """Where `--calibrate` stores the calibration of `device` (a HardwareSpec name) whose
    kernels ran in `dtype` (None: the file of a calibration made before kernels were
    measured per dtype, in the platform's default dtype)."""
    safe = "".join(ch if ch.isalnum() else "_" for ch in device).strip("_")[:80]
    name = f"{safe}.{dtype}.json" if dtype else f"{safe}.json"
    return Path.home() / ".cache" / "tokenmill" / "calibration" / name


def stored(device: str, dtype: str) -> Calibration:
    """The stored calibration of `device` for a model running in `dtype`: the one measured
    in that dtype, else (logged) the one measured in another, else the defaults. A CPU
    without native bf16 runs bf16 GEMMs several times slower than fp32 ones (7x on an AVX2
    EPYC), so an efficiency measured in one dtype says little about another."""
    own = default_path(device, dtype)
    if own.is_file():
        return load(own)
    others = sorted(default_path(device, None).parent.glob(
        default_path(device, None).stem + ".*json"))
    for path in [p for p in others if p != own]:
        cal = load(path)
        measured_in = cal.fitted_to.dtype if cal.fitted_to is not None else "?"
        if measured_in != dtype:
            logger.warning("calibration of %r was measured with %s kernels (%s) and is applied "
                           "to a %s model: `tokenmill plan --calibrate --dtype %s` measures %s",
                           device, measured_in, path, dtype, dtype, dtype)
        return cal
    return Calibration()
