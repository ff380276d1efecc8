"""Agent clients nobody here wrote, unchanged, against `tokenmill serve` with no flags:
the real Claude Code binary (npm `@anthropic-ai/claude-code`) and the OpenAI Agents SDK.
Every request they send must be answered without a 4xx or 5xx.

Both run inside the server's network namespace (loopback only, tests/server/
agent_clients.py), with Claude Code's non-essential traffic and telemetry off and the
Agents SDK's tracing off, so neither can send anything off the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from agent_clients import AGENT_MODEL, isolated_serve, make_agent_model

CLAUDE_CODE_VERSION = "2.1.332"
AGENTS_SCRIPT = Path(__file__).with_name("agents_sdk_run.py")


def claude_code_binary() -> Path:
    """Claude Code, installed with npm into a cache directory when missing (a failed
    install fails the test)."""
    root = Path(os.environ.get("TOKENMILL_TEST_CACHE", Path.home() / ".cache" / "tokenmill-tests"))
    prefix = root / f"claude-code-{CLAUDE_CODE_VERSION}"
    binary = prefix / "node_modules" / ".bin" / "claude"
    if not binary.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
             f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}"],
            capture_output=True, text=True, timeout=600,
        )
        assert r.returncode == 0 and binary.exists(), f"npm install failed:\n{r.stdout}\n{r.stderr}"
    return binary


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_agent_model(tmp_path_factory.mktemp("agent-model"))
    log = tmp_path_factory.mktemp("agent-serve") / "serve.log"
    with isolated_serve(model, log) as srv:
        yield srv


def _no_errors(server, prefix: str) -> list[tuple[str, str, int]]:
    answered = [a for a in server.access_log() if a[1].startswith(prefix)]
    assert answered, f"no request reached {prefix}:\n{server.log.read_text()[-3000:]}"
    bad = [a for a in answered if a[2] >= 400]
    assert not bad, f"{bad}\n{server.log.read_text()[-6000:]}"
    return answered


def test_claude_code_unchanged(server, tmp_path):
    claude = claude_code_binary()
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {
        "PATH": os.environ["PATH"], "HOME": str(home),
        "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "sk-dummy",
        "ANTHROPIC_MODEL": AGENT_MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": AGENT_MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "128",  # answers end by EOS well before
    }
    runs = [["-p", "List the files in this directory."],
            ["-p", "Now summarise what you found.", "--continue"]]  # a second turn
    for args in runs:
        r = server.run([str(claude), *args, "--output-format", "json"], env, 600, work)
        assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        result = json.loads(r.stdout)
        assert result["type"] == "result" and result["is_error"] is False, result
    posts = _no_errors(server, "/v1/messages")
    assert len(posts) >= 2


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_sdk_unchanged(server, tmp_path, api):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "OPENAI_AGENTS_DISABLE_TRACING": "1"}
    r = server.run([sys.executable, str(AGENTS_SCRIPT), server.url, AGENT_MODEL, api], env, 600,
                   tmp_path)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    assert "streamed final:" in r.stdout
    _no_errors(server, "/v1/responses" if api == "responses" else "/v1/chat/completions")
