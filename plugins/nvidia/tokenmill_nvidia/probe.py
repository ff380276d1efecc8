"""Is there an NVIDIA GPU to run on? A probe that imports nothing heavy and never
initialises CUDA: it reads the driver's files (/proc/driver/nvidia, /dev/nvidia*), looks
for `nvidia-smi` on PATH without running it, and checks that torch is a CUDA build and that
triton is installed. With TRITON_INTERPRET=1 the plugin runs its Triton kernels in Triton's
interpreter on CPU tensors instead (correctness only), whatever the machine has.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from tokenmill_triton.platform_kit import Probe, common_probe

_DRIVER_VERSION = Path("/proc/driver/nvidia/version")
_DEV = Path("/dev")


def probe(driver_version: Path = _DRIVER_VERSION, dev: Path = _DEV) -> Probe:
    """What this machine offers the nvidia platform, and why (paths are arguments so that
    tests can point them elsewhere)."""
    if (common := common_probe()) is not None:  # interpreter mode, or no triton
        return common
    devices = sorted(p.name for p in dev.glob("nvidia[0-9]*")) if dev.is_dir() else []
    driver = _driver_version(driver_version)
    smi = shutil.which("nvidia-smi")
    if driver is None and smi is None:
        return Probe(False, False, (
            f"no NVIDIA driver: {driver_version} is missing and nvidia-smi is not on PATH "
            "(set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter)"
        ))
    where = f"driver {driver}" if driver else f"nvidia-smi at {smi}"
    if not devices:
        return Probe(False, False, f"NVIDIA {where} but no GPU device file {dev}/nvidia0..")
    if torch.version.cuda is None:
        return Probe(False, False, (
            f"NVIDIA GPUs are present but torch {torch.__version__} is not a CUDA build; "
            "install torch built for CUDA"
        ))
    return Probe(True, False, (
        f"NVIDIA {where}, {len(devices)} GPU(s) ({', '.join(devices)}), torch CUDA "
        f"{torch.version.cuda}"
    ))


def _driver_version(path: Path) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+([0-9.]+)", text)
    return match.group(1) if match else "unknown version"
