"""`python -m tokenmill.server.cli serve` started in a directory holding a `tokenmill.egg-info`
of an older install (a source checkout: setuptools writes one there) reads that metadata
first, since sys.path[0] is the current directory. Its entry points lacked the core's
model runner, so the served engine stopped with "no model runner for 'qwen3' on platform
'cpu'" while an `LLM` of the same model in a script elsewhere ran: what
benchmarks/bench_planner.py's 1P1D case met (docs/planner.md). The core now registers its
own plugins itself when the metadata does not announce them, and says why."""

from __future__ import annotations

import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import httpx
from conftest import free_port

from tokenmill import LLM, SamplingParams
from tokenmill.platforms.plugins import CORE_PLUGINS
from tokenmill_conformance.tiny_models import make_tiny_model

PROMPT = [(5 * j + 3) % 250 + 5 for j in range(11)]
MAX_NEW = 6


def stale_egg_info(root: Path) -> Path:
    """A tokenmill.egg-info as an install from before the core's runner was a plugin left
    it: the installed metadata with the `tokenmill.model_runners` group taken out."""
    dist = metadata.distribution("tokenmill")
    egg = root / "tokenmill.egg-info"
    egg.mkdir(parents=True)
    (egg / "PKG-INFO").write_text(dist.read_text("METADATA") or dist.read_text("PKG-INFO"))
    groups = {}
    for ep in dist.entry_points:
        groups.setdefault(ep.group, []).append(f"{ep.name} = {ep.value}")
    groups.pop("tokenmill.model_runners")
    (egg / "entry_points.txt").write_text(
        "".join(f"[{g}]\n" + "\n".join(lines) + "\n\n" for g, lines in groups.items()))
    return egg


def test_the_stale_metadata_really_hides_the_core_s_runner(tmp_path):
    """The premise: a script in that directory finds no model_runner entry point."""
    stale_egg_info(tmp_path)
    code = ("from importlib import metadata; "
            "print(len(metadata.entry_points(group='tokenmill.model_runners')))")
    found = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60, check=True)
    assert found.stdout.strip() == "0"


def test_serve_from_a_directory_with_stale_metadata_runs_the_model(tmp_path):
    model = make_tiny_model(tmp_path / "model", "qwen3")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    llm = LLM(str(model), dtype="float32", num_kv_blocks=64)
    expected = llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)[0]
    llm.engine.shutdown()
    checkout = tmp_path / "checkout"
    stale_egg_info(checkout)
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.server.cli", "serve", str(model), "--dtype",
             "float32", "--served-model-name", "tiny", "--kv-cache-memory-bytes", str(8 << 20),
             "--port", str(port)], cwd=checkout, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"serve exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"serve did not start: {log.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        reply = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0,
            "ignore_eos": True}).json()
        assert reply["choices"][0]["text"] == expected.outputs[0].text
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    text = log.read_text()
    assert "the core's model_runner plugin (tokenmill.worker.runner_plugin) is not announced" in text
    assert str(checkout) in text  # names the metadata it read


def test_core_plugins_match_the_entry_points_the_core_announces():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    announced = {group: names["tokenmill"] for group, names in
                 pyproject["project"]["entry-points"].items() if "tokenmill" in names}
    from tokenmill.platforms.plugins import KINDS

    groups = {kind.name: kind.entry_point_group for kind in KINDS}
    assert {groups[kind]: module for kind, module in CORE_PLUGINS.items()} == announced
