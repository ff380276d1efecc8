"""Runs quant_cases.py (the Triton weight-only quantized GEMM against the core's
reference, and the nvidia / rocm ops' choice between it and the logged fallback),
quant_model_cases.py (a GGUF-quantized tiny llama's layers on it) and quant_hf_cases.py
(AWQ, FP8 and AWQ-MoE checkpoints end to end against transformers) each in a
fresh process: with TRITON_INTERPRET=1 on a machine without a GPU, since Triton decides at
import whether kernels are interpreted and this session must not see the variable. Tiny
shapes, so it stays in the default run (test_triton_kernels.py runs the other kernels'
cases with the long tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


@pytest.mark.parametrize("cases", ["quant_cases.py", "quant_model_cases.py", "quant_hf_cases.py"])
def test_quantized_gemm_matches_the_references(tmp_path, cases):
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--rootdir", str(HERE), str(HERE / cases)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                            env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert " passed" in output and "failed" not in output, output[-2000:]
