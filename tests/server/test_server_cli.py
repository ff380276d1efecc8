"""`tokenmill serve` flags: the issue's list is there, and bad values fail before any load."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenmill.server.cli import build_parser, main

FLAGS = ["--host", "--port", "--served-model-name", "--api-key", "--platform", "--max-model-len",
         "--max-num-seqs", "--max-num-batched-tokens", "--dtype", "--chat-template",
         "--enable-auto-tool-choice", "--tool-call-parser", "--distributed-executor-backend",
         "--memory-utilization", "--kv-cache-memory-bytes", "--kv-eviction", "--reasoning-parser",
         "--max-stored-responses", "--kv-offload-host-bytes", "--kv-offload-disk-path",
         "--kv-offload-disk-bytes", "--kv-offload-remote", "--quantization"]


def test_serve_has_the_flags():
    sub = build_parser()._subparsers._group_actions[0].choices["serve"]
    options = {opt for action in sub._actions for opt in action.option_strings}
    assert set(FLAGS) <= options
    args = build_parser().parse_args(["serve"])
    assert args.model is None and (args.host, args.port) == ("127.0.0.1", 8000)


def test_bad_engine_arguments_exit_2(capsys):
    assert main(["serve", "--max-num-seqs", "0", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "max_num_seqs" in err
    assert main(["serve", "--block-size", "3", "--port", "1"]) == 2
    assert "block_size=3 must be a power of two" in capsys.readouterr().err
    assert main(["serve", "--memory-utilization", "1.5", "--port", "1"]) == 2
    assert "memory_utilization" in capsys.readouterr().err


def test_bad_kv_offload_arguments_exit_2(capsys):
    assert main(["serve", "--kv-offload-host-bytes", "8 gigs", "--port", "1"]) == 2
    assert "kv_offload_host_bytes='8 gigs' is not a size" in capsys.readouterr().err
    assert main(["serve", "--kv-offload-disk-path", "/tmp/kv", "--port", "1"]) == 2
    assert "needs kv_offload_disk_bytes" in capsys.readouterr().err
    assert main(["serve", "--kv-offload-remote", "127.0.0.1:6379", "--port", "1"]) == 2
    assert "is not a URL" in capsys.readouterr().err


def test_unknown_tool_call_parser_lists_the_choices(capsys):
    assert main(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "nope", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "hermes" in err and "llama3_json" in err


def test_unknown_reasoning_parser_lists_the_choices(capsys):
    assert main(["serve", "--reasoning-parser", "nope", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "qwen3" in err and "deepseek_r1" in err


def test_vllm_spellings_are_aliases():
    args = build_parser().parse_args([
        "serve", "--gpu-memory-utilization", "0.5", "--uvicorn-log-level", "debug",
        "--model", "/models/x", "--no-enable-prefix-caching"])
    assert (args.memory_utilization, args.log_level) == (0.5, "debug")
    assert (args.model_option, args.enable_prefix_caching) == ("/models/x", False)


def test_served_model_name_takes_one_name_unless_repeated():
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "/models/x"])
    assert (args.served_model_name, args.model) == (["a"], "/models/x")
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "--served-model-name", "b"])
    assert args.served_model_name == ["a", "b"]


@pytest.mark.parametrize("typo, nearest", [("--max-num-seq", "--max-num-seqs"),
                                            ("--gpu-memory-utilisation", "--gpu-memory-utilization"),
                                            ("--max-num", "--max-num-seqs")])
def test_an_unknown_flag_names_the_nearest(typo, nearest, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", typo, "4"])  # an abbreviation is not taken for a flag either
    assert exit_.value.code == 2
    assert f"{typo} (did you mean {nearest}?)" in capsys.readouterr().err


def test_two_models_and_a_missing_model_are_one_line(tmp_path, capsys):
    assert main(["serve", "/models/a", "--model", "/models/b", "--port", "1"]) == 2
    assert "two models given" in capsys.readouterr().err
    missing = tmp_path / "no-such-model"
    r = subprocess.run([sys.executable, "-m", "tokenmill.server.cli", "serve", str(missing),
                        "--port", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = [line for line in r.stderr.splitlines() if str(missing) in line]
    assert len(lines) == 1 and "does not exist" in lines[0], r.stderr
