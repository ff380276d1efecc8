"""plugins/nvidia/hardware/run.sh --dry-run: the prepared GPU run's plumbing (platform
listing, certification, kernel table, the Llama benchmark and its report) on a tiny model in
Triton's interpreter, so the script is known to run before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.certify  # minutes: .ci/run runs these with -m certify

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "plugins" / "nvidia" / "hardware" / "run.sh"


def test_hardware_script_dry_run(tmp_path):
    env = {**os.environ, "TOKENMILL_HW_WORKDIR": str(tmp_path / "work"),
           "TOKENMILL_HW_OUT": str(tmp_path / "out"),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True,
                            timeout=900, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Triton interpreter on CPU" in output  # `tokenmill platforms`
    cert = json.loads((tmp_path / "out" / "nvidia-dry-run.json").read_text())
    assert cert["plugin"]["name"] == "nvidia" and cert["tiers"][0]["status"] == "passed"
    report = (tmp_path / "out" / "hardware-results.md").read_text()
    assert "dry run" in report
    for case in ("decode, batch 1", "decode, batch 4", "prefill, 24 tokens"):
        assert f"| {case} |" in report
    assert "max abs error vs reference" in report  # the kernel table, interpreter mode
    assert "Conformance (nvidia-dry-run.json)" in report
