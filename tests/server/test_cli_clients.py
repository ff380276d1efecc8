"""`tokenmill chat`, `tokenmill complete` and `tokenmill bench serve` against a real server."""

from __future__ import annotations

import io
import json
import socket

import openai
import pytest
from conftest import TINY_NAME

from tokenmill.server.cli import main


def _sdk(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)


def test_chat_quick_and_interactive(base_url, capsys, monkeypatch):
    flags = ["--url", f"{base_url}/v1", "--max-tokens", "5", "--temperature", "0"]
    assert main(["chat", *flags, "-q", "Hello"]) == 0
    expected = _sdk(base_url).chat.completions.create(
        model=TINY_NAME, max_tokens=5, temperature=0,
        messages=[{"role": "user", "content": "Hello"}]).choices[0].message.content
    assert capsys.readouterr().out == expected + "\n"
    # two lines on stdin: the second turn sees the first turn's answer
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nAnd then?\n"))
    assert main(["chat", *flags, "--system-prompt", "Be brief."]) == 0
    out = capsys.readouterr().out
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = _sdk(base_url).chat.completions.create(
        model=TINY_NAME, max_tokens=5, temperature=0, messages=history).choices[0].message.content
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    second = _sdk(base_url).chat.completions.create(
        model=TINY_NAME, max_tokens=5, temperature=0, messages=history).choices[0].message.content
    assert out == f"> {first}\n> {second}\n> "


def test_complete_quick(base_url, capsys):
    assert main(["complete", "--url", f"{base_url}/v1", "--model", TINY_NAME, "-q", "Paris is",
                 "--max-tokens", "4", "--temperature", "0"]) == 0
    expected = _sdk(base_url).completions.create(model=TINY_NAME, prompt="Paris is", max_tokens=4,
                                                 temperature=0).choices[0].text
    assert capsys.readouterr().out == expected + "\n"


def test_bench_serve(base_url, tmp_path, capfd):
    out = tmp_path / "bench.json"
    assert main(["bench", "serve", "--base-url", base_url, "--num-prompts", "3", "--input-len",
                 "8", "--output-len", "3", "--max-concurrency", "2", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["requests"] == 3 and summary["failed"] == 0
    assert summary["output_tokens"] == 9 and summary["prompt_tokens"] > 0
    assert "ttft_p50_ms" in capfd.readouterr().out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the with ends: nothing listens there


@pytest.mark.parametrize("command", [["chat", "-q", "Hi"], ["complete", "-q", "Hi"],
                                     ["bench", "serve", "--num-prompts", "1"]])
def test_no_server_is_one_line_saying_what_to_do(command, capfd):
    url = f"http://127.0.0.1:{_closed_port()}"
    flag = ["--base-url", url] if command[0] == "bench" else ["--url", f"{url}/v1"]
    assert main([*command, *flag]) != 0
    out, err = capfd.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert "no server answers at" in err and "tokenmill serve" in err
