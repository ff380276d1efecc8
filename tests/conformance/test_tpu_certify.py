"""The tpu plugin is certified on JAX's CPU backend with four devices: tiers T0-T3 in a
fresh process with JAX_PLATFORMS=cpu and four forced host devices, T3 running the
plugin's own model runner (the core's torch graph is not used). With
TOKENMILL_WRITE_CERTIFICATES=1 it copies the certificate it checked to
docs/certificates/tpu-jax-cpu.{json,md}."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill_conformance.certificate import validate

pytestmark = pytest.mark.certify  # minutes: .ci/run runs these with -m certify

CERTIFICATES = Path(__file__).parents[2] / "docs" / "certificates"
JAX_CPU_4 = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def test_tpu_plugin_certified_t0_to_t3_on_jax_cpu(tmp_path):
    report = tmp_path / "cert.json"
    command = [sys.executable, "-m", "tokenmill_conformance.cli", "--platform", "tpu",
               "--tier", "T0-T3", "--quick", "-q", "--report", str(report),
               "--markdown", str(tmp_path / "cert.md")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500,
                            cwd=tmp_path, env={**os.environ, **JAX_CPU_4})
    output = result.stdout + result.stderr
    assert report.exists(), output[-4000:]
    certificate = json.loads(report.read_text())
    validate(certificate)
    assert result.returncode == 0, output[-4000:]
    tiers = {t["tier"]: t["status"] for t in certificate["tiers"]}
    assert [tiers[t] for t in ("T0", "T1", "T2", "T3")] == ["passed"] * 4, certificate["failures"]
    assert certificate["plugin"]["distribution"] == "tokenmill-tpu"
    ids = {t["id"] for t in certificate["tests"]}
    for expected in (
        "t1/test_attention.py::test_unwritten_slots_are_never_read[sliding_window-bfloat16]",
        "t1/test_collectives.py::test_collective[world4-send_recv-int64]",
        "t3/test_greedy.py::test_greedy_matches_reference[qwen3]",
    ):
        assert expected in ids, expected
    assert ("tokenmill-conformance: 'tpu' PASSED the selected tiers (partial run; quick check, "
            "not a certificate)") in output
    if os.environ.get("TOKENMILL_WRITE_CERTIFICATES") == "1":
        for suffix in ("json", "md"):
            shutil.copy(tmp_path / f"cert.{suffix}", CERTIFICATES / f"tpu-jax-cpu.{suffix}")
