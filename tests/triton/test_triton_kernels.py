"""Runs the case files (the shared Triton kernels against the core's references:
kernel_cases.py, gated_delta_cases.py, kda_cases.py, mamba2_cases.py, linear_cases.py,
mla_cases.py, nvidia_config_cases.py, rocm_config_cases.py; hybrid_greedy_cases.py end to
end on the nvidia plugin) each in a fresh process: with TRITON_INTERPRET=1 on a machine
without a GPU, since Triton decides at import whether kernels are interpreted and this
session must not see the variable. The quantized GEMM's case files run in the default
run: test_triton_quant.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # every Triton kernel in the interpreter, a subprocess per file: minutes

HERE = Path(__file__).parent


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("cases", ["kernel_cases.py", "gated_delta_cases.py", "kda_cases.py",
                                   "mamba2_cases.py", "linear_cases.py", "mla_cases.py",
                                   "nvidia_config_cases.py", "rocm_config_cases.py",
                                   "hybrid_greedy_cases.py"])
def test_triton_kernels_match_the_references(tmp_path, cases):
    env = dict(os.environ)
    if not _has_gpu():
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--rootdir", str(HERE), str(HERE / cases)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                            env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert " passed" in output and "failed" not in output, output[-2000:]
