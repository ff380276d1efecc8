"""The certificate: what was tested, on what, and what passed, as JSON and Markdown.

The JSON shape is `certificate.schema.json` (JSON Schema, documented field by field in
docs/certificate-schema.md). A certificate is granted (`certified: true`) only when every
required tier ran and passed; waived tests count as passed only in waivable tiers.
"""

from __future__ import annotations

import json
import platform as host
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
import torch

import tokenmill
import tokenmill_conformance
from tokenmill.platforms.interfaces import PLUGIN_API_VERSION
from tokenmill.platforms.registry import PlatformError
from tokenmill_conformance.compile_record import compile_lines
from tokenmill_conformance.session import Conformance
from tokenmill_conformance.tiers import TIERS, tier_of

SCHEMA_VERSION = "1.1"
QUICK_LABEL = "quick check, not a certificate"
SCHEMA_PATH = Path(__file__).with_name("certificate.schema.json")
_OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
_MAX_MESSAGE = 2000


@dataclass(slots=True)
class Waiver:
    id: str
    reason: str
    status: str  # "applied" | "rejected" | "unmatched"
    note: str = ""


@dataclass(slots=True)
class TestResult:
    id: str
    tier: str
    outcome: str  # one of _OUTCOMES
    duration_s: float = 0.0
    message: str = ""
    waiver: str | None = None


@dataclass(slots=True)
class Recorder:
    """Collects the outcome of every test phase into one result per test."""

    tiers: list[str]
    started: float
    waivers: list[Waiver] = field(default_factory=list)
    results: dict[str, TestResult] = field(default_factory=dict)  # by suite id
    ids: dict[str, str] = field(default_factory=dict)  # pytest node id -> suite id

    def add(self, report: pytest.TestReport) -> None:
        test_id = self.ids.get(report.nodeid)
        if test_id is None:  # not a suite test (a plugin's own test in the same session)
            return
        result = self.results.setdefault(test_id, TestResult(test_id, tier_of(test_id), "passed"))
        result.duration_s += report.duration
        wasxfail = getattr(report, "wasxfail", None)
        if wasxfail is not None:
            result.waiver = wasxfail.removeprefix("waived: ")
        outcome = _outcome(report)
        if outcome is None:
            return
        result.outcome = outcome
        if report.longrepr is not None and outcome in ("failed", "error", "skipped", "xfailed"):
            result.message = _message(report)


    def add_collection_error(self, report: pytest.CollectReport) -> None:
        """A suite module that failed to import fails its tier (its tests never ran)."""
        parts = report.nodeid.split("::")[0].split("/")
        tiers = [p for p in parts if p.upper() in {t.id for t in TIERS}]
        if not tiers:
            return
        test_id = "/".join(parts[parts.index(tiers[-1]) :])
        message = _message(report)
        self.results[test_id] = TestResult(test_id, tiers[-1].upper(), "error", 0.0, message)


def _outcome(report: pytest.TestReport) -> str | None:
    """The test's outcome from one phase's report; None when the phase changes nothing."""
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if xfail:
            return "xfailed" if report.skipped else "xpassed"
        return report.outcome
    if report.failed:
        return "error"
    if report.skipped:
        return "xfailed" if xfail else "skipped"
    return None


def _message(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        return str(longrepr[2])[:_MAX_MESSAGE]
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    return text[:_MAX_MESSAGE]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _capabilities(conformance: Conformance) -> dict | None:
    if conformance.active is None:
        return None
    caps = conformance.active.platform.capabilities
    return {
        "attention_kinds": sorted(k.value for k in caps.attention_kinds),
        "dtypes": sorted(_dtype_name(d) for d in caps.dtypes),
        "block_sizes": sorted(caps.block_sizes),
        "head_sizes": sorted(caps.head_sizes),
        "collectives": caps.collectives,
        "graphs": caps.graphs,
        "sleep_mode": caps.sleep_mode,
        "kv_cache_dtypes": sorted(_dtype_name(d) for d in caps.kv_cache_dtypes),
    }


def _hardware(conformance: Conformance) -> dict | None:
    if conformance.active is None:
        return None
    platform = conformance.active.platform
    about = {"device_type": platform.device_type, "host": host.node(), "spec": None}
    try:
        spec = conformance.active.hardware_spec()
    except PlatformError as exc:  # a bad spec fails T0; the certificate still says what it was
        about["spec_error"] = str(exc)
        return about
    about["spec"] = {
        "name": spec.name,
        "peak_flops": dict(spec.peak_flops),
        "memory_bandwidth": spec.memory_bandwidth,
        "memory_bytes": spec.memory_bytes,
        "link_bandwidth": spec.link_bandwidth,
    }
    return about


def _tier_summary(recorder: Recorder, results: list[TestResult]) -> list[dict]:
    summary = []
    for tier in TIERS:
        mine = [r for r in results if r.tier == tier.id]
        counts = {o: sum(r.outcome == o for r in mine) for o in _OUTCOMES}
        if tier.id not in recorder.tiers:
            status = "not_run"
        elif counts["failed"] or counts["error"] or (not tier.waivable and _waived(mine)):
            status = "failed"
        elif not mine:
            status = "empty"
        else:
            status = "passed" if tier.required else "reported"
        summary.append(
            {
                "tier": tier.id,
                "title": tier.title,
                "required": tier.required,
                "waivable": tier.waivable,
                "status": status,
                "counts": counts,
                "duration_s": round(sum(r.duration_s for r in mine), 3),
            }
        )
    return summary


def _waived(results: list[TestResult]) -> bool:
    return any(r.outcome in ("xfailed", "xpassed") for r in results)


def build_certificate(conformance: Conformance, recorder: Recorder) -> dict:
    """The certificate of one run, as a JSON-able dict (see certificate.schema.json)."""
    finished = time.time()
    results = sorted(recorder.results.values(), key=lambda r: (r.tier, r.id))
    tiers = _tier_summary(recorder, results)
    required = [t for t in tiers if t["required"]]
    active = conformance.active
    refused = any(t["status"] in ("failed", "empty") for t in required)
    partial = any(t["status"] == "not_run" for t in tiers)
    return {
        "schema_version": SCHEMA_VERSION,
        # a quick run checks the same shapes with smaller budgets: it never certifies
        "certified": all(t["status"] == "passed" for t in required) and not conformance.quick,
        "kind": "quick_check" if conformance.quick else "certificate",
        "verdict": verdict(refused, partial, conformance.quick),
        "complete": all(t["status"] != "not_run" for t in tiers),
        "plugin": {
            "name": conformance.source.name,
            "distribution": conformance.distribution,
            "version": conformance.version,
            "platform_version": active.platform.version if active else None,
            "load_error": conformance.load_error or None,
        },
        "versions": {
            "core": tokenmill.__version__,
            "suite": tokenmill_conformance.__version__,
            "plugin_api": PLUGIN_API_VERSION,
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "pytest": metadata.version("pytest"),
        },
        "hardware": _hardware(conformance),
        "capabilities": _capabilities(conformance),
        "options": {"quick": conformance.quick, "tiers": recorder.tiers},
        "started_at": _iso(recorder.started),
        "finished_at": _iso(finished),
        "duration_s": round(finished - recorder.started, 3),
        "tiers": tiers,
        "failures": [
            {"tier": r.tier, "id": r.id, "message": r.message}
            for r in results
            if r.outcome in ("failed", "error")
            or (r.outcome in ("xfailed", "xpassed") and r.tier in _CORE)
        ],
        "waivers": [asdict(w) for w in recorder.waivers],
        "tests": [asdict(r) | {"duration_s": round(r.duration_s, 4)} for r in results],
        "performance": conformance.performance or None,
        "calibration": calibration(conformance),
        "compile": conformance.compile_records or None,
    }


def verdict(refused: bool, partial: bool, quick: bool) -> str:
    """The verdict in words: "CERTIFIED", "NOT CERTIFIED", "PASSED (quick check, not a
    certificate)", "PASSED the selected tiers (partial, not a certificate)" (a quick
    partial run says both)."""
    if refused:
        return "NOT CERTIFIED" + (f" ({QUICK_LABEL})" if quick else "")
    if partial:
        return ("PASSED the selected tiers (partial run"
                + ("; quick check, not a certificate)" if quick else ", not a certificate)"))
    return f"PASSED ({QUICK_LABEL})" if quick else "CERTIFIED"


def calibration(conformance: Conformance) -> dict | None:
    """Tier T5's measurements as calibration data in the planner's format (`tokenmill plan
    --calibrate` reads a certificate; docs/certificate-schema.md): per op class the
    efficiencies the measurements give, and every measurement record under `measured`."""
    records = conformance.calibration
    if not records:
        return None
    spec = (_hardware(conformance) or {}).get("spec") or {}

    def best(op: str, key: str, phase: str = "") -> float | None:
        values = [r[key] for r in records
                  if r["op"] == op and r[key] and r["shape"].startswith(phase)]
        return max(values) if values else None

    copy = best("memory_copy", "fraction_of_bandwidth")
    efficiency = {}
    for op, compute, memory in (
        ("gemm", best("gemm", "fraction_of_peak_flops"), copy),
        ("attention_full", best("attention_full", "fraction_of_peak_flops", "prefill"),
         best("attention_full", "fraction_of_bandwidth", "decode")),
    ):
        if compute and memory:
            efficiency[op] = {"compute": compute, "memory": memory}
    return {
        "format": CALIBRATION_FORMAT,
        "version": CALIBRATION_VERSION,
        "device": spec.get("name"),
        "platform": conformance.source.name,
        "efficiency": efficiency,
        "measured": {
            "source": "conformance tier T5",
            "device_type": conformance.active.platform.device_type if conformance.active else None,
            "declared": {k: spec.get(k) for k in ("peak_flops", "memory_bandwidth")},
            "quick": conformance.quick,
            "measurements": records,
        },
    }


CALIBRATION_FORMAT = "tokenmill-calibration"  # the planner's (tokenmill.planner.calibration)
CALIBRATION_VERSION = 1


_CORE = frozenset(t.id for t in TIERS if not t.waivable)


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def write(certificate: dict, json_path: str | None, markdown_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(certificate, indent=2) + "\n")
    if markdown_path:
        Path(markdown_path).write_text(render_markdown(certificate))


def render_markdown(cert: dict) -> str:
    """The certificate for people: verdict, versions, tiers, failures, waivers, T5."""
    plugin, versions = cert["plugin"], cert["versions"]
    quick = cert["kind"] == "quick_check"
    title = QUICK_LABEL if quick else "certificate"
    lines = [
        f"# tokenmill conformance {title}: {plugin['name']}",
        "",
        f"**{cert['verdict']}**" + ("" if cert["complete"] else " (partial run: not every tier ran)"),
        "",
        f"- plugin: {plugin['name']} ({plugin['distribution']} {plugin['version']})",
        f"- core {versions['core']}, suite {versions['suite']}, plugin API "
        f"{versions['plugin_api']}, torch {versions['torch']}, python {versions['python']}",
        f"- run: {cert['started_at']} to {cert['finished_at']} ({cert['duration_s']:.1f} s), "
        f"quick={cert['options']['quick']}",
    ]
    if plugin.get("platform_version"):  # e.g. which dtypes an emulated run could check
        lines.append(f"- platform version: {plugin['platform_version']}")
    if plugin.get("load_error"):
        lines.append(f"- load error: {plugin['load_error']}")
    hardware = cert["hardware"] or {}
    spec = hardware.get("spec")
    if spec:
        flops = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in spec["peak_flops"].items())
        lines.append(
            f"- hardware: {spec['name']} ({hardware['device_type']}): {flops}; "
            f"{spec['memory_bandwidth'] / 1e9:.3g} GB/s, {spec['memory_bytes'] / 2**30:.1f} GiB"
        )
    if cert["capabilities"]:
        caps = "; ".join(f"{k}: {v}" for k, v in cert["capabilities"].items())
        lines.append(f"- capabilities: {caps}")
    lines += ["", "## Tiers", "", "| tier | status | passed | failed | skipped | waived | s |"]
    lines.append("|---|---|---|---|---|---|---|")
    for t in cert["tiers"]:
        c = t["counts"]
        waived = c["xfailed"] + c["xpassed"]
        lines.append(
            f"| {t['tier']} {t['title'].split(':')[0]} | {t['status']} | {c['passed']} | "
            f"{c['failed'] + c['error']} | {c['skipped']} | {waived} | {t['duration_s']:.1f} |"
        )
    if cert["failures"]:
        lines += ["", "## Failures", ""]
        lines += [f"- [{f['tier']}] `{f['id']}`: {_one_line(f['message'])}" for f in cert["failures"]]
    lines += ["", "## Waivers", ""]
    lines += [
        f"- `{w['id']}`: {w['reason']} ({w['status']}{'; ' + w['note'] if w['note'] else ''})"
        for w in cert["waivers"]
    ] or ["none"]
    if cert["performance"]:
        lines += ["", "## T5 performance (checked against the declared spec)", ""]
        lines += _performance_lines(cert["performance"])
    if cert.get("compile"):
        lines += ["", "## Kernels compiled for real targets", ""]
        lines += compile_lines(cert["compile"])
    lines += ["", "## Tests", "", "| test | outcome | s |", "|---|---|---|"]
    lines += [f"| `{r['id']}` | {r['outcome']} | {r['duration_s']:.2f} |" for r in cert["tests"]]
    return "\n".join(lines) + "\n"


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def _performance_lines(perf: dict) -> list[str]:
    lines = []
    matmul = perf.get("matmul") or {}
    if matmul:
        lines += ["| matmul | n | achieved TFLOP/s | declared TFLOP/s | of declared |",
                  "|---|---|---|---|---|"]
        for dtype, m in matmul.items():
            declared = m["declared_flops"]
            lines.append(
                f"| {dtype} | {m['n']} | {m['achieved_flops'] / 1e12:.3g} | "
                f"{declared / 1e12 if declared else float('nan'):.3g} | "
                f"{_percent(m['fraction_of_declared'])} |"
            )
        lines.append("")
    bandwidth = perf.get("memory_bandwidth")
    if bandwidth:
        lines += [
            f"- memory bandwidth (device copy of {bandwidth['bytes_copied'] >> 20} MiB): "
            f"{bandwidth['achieved_bytes_per_s'] / 1e9:.3g} GB/s achieved, "
            f"{bandwidth['declared_bytes_per_s'] / 1e9:.3g} GB/s declared "
            f"({_percent(bandwidth['fraction_of_declared'])})",
            "",
        ]
    for phase, a in (perf.get("attention") or {}).items():
        lines.append(
            f"- attention {phase}: {a['backend']} {a['dtype']}, {a['batch']}: "
            f"{a['seconds_per_layer'] * 1e3:.3g} ms per layer, "
            f"{a['kv_bytes_read_per_s'] / 1e9:.3g} GB/s of KV"
        )
    return lines


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction:.0%}"


def validate(certificate: dict) -> None:
    """Raise `jsonschema.ValidationError` when `certificate` does not match the schema."""
    import jsonschema

    jsonschema.validate(certificate, json.loads(SCHEMA_PATH.read_text()))
