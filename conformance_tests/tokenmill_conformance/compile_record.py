"""The certificate's `compile` section: the plugin's kernels compiled ahead of time for the
real targets it ships settings for (`tokenmill_kernel_builds`, checked by tier T1), one
record per target, kernel and launch configuration, and how it is shown in Markdown."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict

from tokenmill.platforms.interfaces import KernelBuild


def compile_section(builds: list[KernelBuild]) -> dict:
    """{"targets": per target: kernels compiled, failures, spills, the largest register
    and shared-memory use; "kernels": every record}."""
    by_target: dict[str, list[KernelBuild]] = defaultdict(list)
    for build in builds:
        by_target[build.target].append(build)
    targets = []
    for target, mine in sorted(by_target.items()):
        ok = [b for b in mine if b.error is None]
        targets.append({
            "target": target,
            "kernels": len(mine),
            "errors": sum(b.error is not None for b in mine),
            "spills": sum((b.spill_bytes or 0) > 0 for b in ok),
            "max_registers": max((b.registers for b in ok if b.registers is not None), default=None),
            "max_shared_bytes": max((b.shared_bytes for b in ok if b.shared_bytes is not None),
                                    default=None),
            "seconds": round(sum(b.seconds for b in mine), 1),
            "notes": sorted({b.note for b in mine if b.note}),
        })
    return {"targets": targets, "kernels": [asdict(b) for b in builds]}


def problems(builds: list[KernelBuild]) -> list[str]:
    """What fails T1: every compile error and every spill, one line each."""
    lines = []
    for b in builds:
        if b.error is not None:
            lines.append(f"{b.target} {b.kernel} [{b.config}] ({b.case}): compile error: {b.error}")
        elif (b.spill_bytes or 0) > 0:
            lines.append(f"{b.target} {b.kernel} [{b.config}] ({b.case}): spills "
                         f"{b.spill_bytes} bytes (registers {b.registers})")
    return lines


def compile_lines(section: dict) -> list[str]:
    """Markdown: a line per target, then a table per target of every kernel record."""
    lines = ["| target | kernels | errors | spilling | max registers | max shared bytes | s | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for t in section["targets"]:
        lines.append(f"| {t['target']} | {t['kernels']} | {t['errors']} | {t['spills']} | "
                     f"{t['max_registers']} | {t['max_shared_bytes']} | {t['seconds']} | "
                     f"{'; '.join(t['notes'])} |")
    for t in section["targets"]:
        lines += ["", f"### {t['target']}", "",
                  "| kernel | case | registers | spill bytes | shared bytes | config / error |",
                  "|---|---|---|---|---|---|"]
        for k in section["kernels"]:
            if k["target"] != t["target"]:
                continue
            detail = k["error"] if k["error"] else k["config"]
            lines.append(f"| {k['kernel']} | {k['case']} | {k['registers']} | "
                         f"{k['spill_bytes']} | {k['shared_bytes']} | "
                         f"{' '.join(str(detail).split())[:300]} |")
    return lines
