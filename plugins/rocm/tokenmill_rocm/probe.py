"""Is there an AMD GPU to run on? A probe that imports nothing heavy and never initialises
HIP: it looks for the kernel driver's /dev/kfd, counts GPU nodes in the KFD topology
(/sys/class/kfd/kfd/topology/nodes/*/properties with a non-zero gfx_target_version; CPU
nodes have 0), looks for `rocm-smi` on PATH without running it, and checks that torch is a
ROCm build and that triton is installed. With TRITON_INTERPRET=1 the plugin runs its Triton
kernels in Triton's interpreter on CPU tensors instead (correctness only).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from tokenmill_triton.platform_kit import Probe, common_probe

_KFD = Path("/dev/kfd")
_TOPOLOGY = Path("/sys/class/kfd/kfd/topology/nodes")


def probe(kfd: Path = _KFD, topology: Path = _TOPOLOGY) -> Probe:
    """What this machine offers the rocm platform, and why (paths are arguments so that
    tests can point them elsewhere)."""
    if (common := common_probe()) is not None:  # interpreter mode, or no triton
        return common
    smi = shutil.which("rocm-smi")
    if not kfd.exists():
        why = f"{kfd} is missing (the amdgpu kernel driver is not loaded)"
        if smi:
            why += f", although rocm-smi is at {smi}"
        return Probe(False, False, why + " (set TRITON_INTERPRET=1 to run the kernels in "
                     "Triton's CPU interpreter)")
    targets = gpu_targets(topology)
    if not targets:
        return Probe(False, False, f"{kfd} exists but the KFD topology {topology} lists no GPU")
    if torch.version.hip is None:
        return Probe(False, False, (
            f"AMD GPUs are present but torch {torch.__version__} is not a ROCm build; install "
            "torch built for ROCm"
        ))
    return Probe(True, False, (
        f"{len(targets)} AMD GPU(s) (gfx target {', '.join(sorted(set(targets)))}) via {kfd}, "
        f"torch HIP {torch.version.hip}"
    ))


def gpu_targets(topology: Path) -> list[str]:
    """The gfx_target_version of every GPU node of the KFD topology (e.g. '90402')."""
    targets = []
    for properties in sorted(topology.glob("*/properties")):
        try:
            text = properties.read_text()
        except OSError:
            continue
        match = re.search(r"^gfx_target_version\s+(\d+)", text, re.MULTILINE)
        if match and int(match.group(1)) != 0:
            targets.append(match.group(1))
    return targets
