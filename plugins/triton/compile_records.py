"""Writes docs/certificates/{nvidia,rocm}-compile.{json,md}: every Triton kernel and launch
configuration of the plugins compiled ahead of time for their real targets (nvidia: sm_90,
sm_100; rocm: gfx942, gfx950) with the ptxas / LLVM in the triton wheel, no GPU needed.
The same records the conformance suite puts into a certificate's `compile` section (T1,
`tokenmill_kernel_builds`).

    python plugins/triton/compile_records.py [nvidia] [rocm]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tokenmill_conformance.compile_record import compile_lines, compile_section, problems

OUT = Path(__file__).resolve().parents[2] / "docs" / "certificates"


def write(plugin: str) -> int:
    module = __import__(f"tokenmill_{plugin}.plugin", fromlist=["plugin"])
    start = time.perf_counter()
    builds = module.plugin.kernel_builds()
    seconds = time.perf_counter() - start
    section = compile_section(builds)
    (OUT / f"{plugin}-compile.json").write_text(json.dumps(section, indent=1) + "\n")
    found = problems(builds)
    targets = ", ".join(t for t, _ in module.BUILD_TARGETS)
    lines = [f"# {plugin}: Triton kernels compiled for {targets}", "",
             f"`python plugins/triton/compile_records.py {plugin}` ({seconds:.0f} s wall on "
             "this machine; no GPU): every kernel and launch configuration the plugin's "
             "launchers produce at production shapes (tokenmill_triton/aot_cases.py), compiled "
             "with the triton wheel's LLVM and ptxas; registers and spills from `ptxas -v` "
             "(NVIDIA) or the AMDGPU metadata (AMD), shared memory from Triton's metadata.", "",
             f"**{len(found)} problems** (compile errors or spills) in {len(builds)} builds.", ""]
    lines += [f"- {p}" for p in found]
    lines += compile_lines(section)
    (OUT / f"{plugin}-compile.md").write_text("\n".join(lines) + "\n")
    print(f"{plugin}: {len(builds)} builds, {len(found)} problems, {seconds:.0f} s")
    return len(found)


if __name__ == "__main__":
    plugins = sys.argv[1:] or ["nvidia", "rocm"]
    sys.exit(1 if sum(write(p) for p in plugins) else 0)
