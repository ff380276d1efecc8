"""Writes docs/certificates/{nvidia,rocm}-compile.{json,md}: every Triton kernel and launch
configuration of the plugins compiled ahead of time for their real targets (nvidia: sm_90,
sm_100; rocm: gfx942, gfx950) with the ptxas / LLVM in the triton wheel, no GPU needed.
The same records the conformance suite puts into a certificate's `compile` section (T1,
`tokenmill_kernel_builds`).

    python plugins/triton/compile_records.py [nvidia] [rocm]
    python plugins/triton/compile_records.py nvidia --only CASE... [--targets sm_90...]
        [--out STEM]

`--only` compiles the named aot_cases launches (`python -m tokenmill_triton.aot
tokenmill_nvidia.configs:HOPPER sm_90 --list` names them) and writes STEM.{json,md}
(default {plugin}-compile-only) beside the full record, which it leaves as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokenmill.platforms.interfaces import KernelBuild
from tokenmill_conformance.compile_record import compile_lines, compile_section, problems

OUT = Path(__file__).resolve().parents[2] / "docs" / "certificates"


def write(plugin: str, only: list[str] | None = None, targets: list[str] | None = None,
          out: str | None = None) -> int:
    from tokenmill_triton.aot import compile_plugin

    module = __import__(f"tokenmill_{plugin}.plugin", fromlist=["plugin"])
    builds_for = dict(module.BUILD_TARGETS)
    unknown = sorted(set(targets or []) - set(builds_for))
    if unknown:
        raise SystemExit(f"{plugin} has no build target(s) {unknown}; it has {sorted(builds_for)}")
    if targets:
        builds_for = {t: ref for t, ref in builds_for.items() if t in targets}
    start = time.perf_counter()
    builds = [KernelBuild(**r) for r in compile_plugin(builds_for, cases=only)]
    seconds = time.perf_counter() - start
    section = compile_section(builds)
    stem = f"{plugin}-compile" if not only else out or f"{plugin}-compile-only"
    command = " ".join(["python plugins/triton/compile_records.py", plugin]
                       + (["--only", *(f'"{c}"' for c in only)] if only else [])
                       + (["--targets", *targets] if targets else [])
                       + (["--out", out] if only and out else []))
    (OUT / f"{stem}.json").write_text(json.dumps(section, indent=1) + "\n")
    found = problems(builds)
    scope = ("every kernel and launch configuration the plugin's launchers produce at "
             "production shapes (tokenmill_triton/aot_cases.py)") if not only else (
        f"only the launches {', '.join(only)} of tokenmill_triton/aot_cases.py, not the full "
        f"record (that is {plugin}-compile.md)")
    lines = [f"# {plugin}: Triton kernels compiled for {', '.join(builds_for)}", "",
             f"`{command}` ({seconds:.0f} s wall on this machine, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; no GPU): {scope}, "
             "compiled with the triton wheel's LLVM and ptxas; registers and spills from "
             "`ptxas -v` (NVIDIA) or the AMDGPU metadata (AMD), shared memory from Triton's "
             "metadata.", "",
             f"**{len(found)} problems** (compile errors or spills) in {len(builds)} builds.", ""]
    lines += [f"- {p}" for p in found]
    lines += compile_lines(section)
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"{plugin}: {len(builds)} builds, {len(found)} problems, {seconds:.0f} s")
    return len(found)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plugins", nargs="*", choices=["nvidia", "rocm"], default=[])
    parser.add_argument("--only", nargs="+", metavar="CASE", help="aot_cases names")
    parser.add_argument("--targets", nargs="+", metavar="TARGET")
    parser.add_argument("--out", metavar="STEM", help="with --only: the files' name")
    args = parser.parse_args(argv)
    if args.out and not args.only:
        parser.error("--out names the record of an --only run; the full record is "
                     "{plugin}-compile")
    plugins = args.plugins or ["nvidia", "rocm"]
    return 1 if sum(write(p, args.only, args.targets, args.out) for p in plugins) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
