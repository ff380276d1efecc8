"""`LLM()` in a plain script logs at INFO on stderr, as vLLM's does: what it loads, the
KV pool it sizes, the defaults it applies; an application that set up logging, or
TOKENMILL_CONFIGURE_LOGGING=0, keeps its own."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import logging, sys
if sys.argv[2] == "configured":
    logging.basicConfig(level=logging.WARNING)
from tokenmill import LLM
LLM(sys.argv[1], dtype="float32", block_size=4, platform="cpu", num_kv_blocks=64)
"""


def _run(model, how: str, **env: str) -> str:
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(model), how], capture_output=True,
                       text=True, timeout=600, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_llm_logs_at_info_unless_the_application_configured_logging(tiny_dirs):
    plain = _run(tiny_dirs["llama"], "plain")
    assert f"INFO tokenmill.engine.llm_engine: loading {tiny_dirs['llama']} (llama) on platform cpu" in plain
    assert "INFO tokenmill.engine.llm_engine: engine ready" in plain
    assert "INFO tokenmill.engine.llm_engine: default sampling parameters" in plain
    assert "INFO" not in _run(tiny_dirs["llama"], "configured")  # its root logger: WARNING
    assert "INFO" not in _run(tiny_dirs["llama"], "plain", TOKENMILL_CONFIGURE_LOGGING="0")
