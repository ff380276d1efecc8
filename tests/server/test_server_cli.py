"""`tokenmill serve` flags: the issue's list is there, and bad values fail before any load."""

from __future__ import annotations

from tokenmill.server.cli import build_parser, main

FLAGS = ["--host", "--port", "--served-model-name", "--api-key", "--platform", "--max-model-len",
         "--max-num-seqs", "--max-num-batched-tokens", "--dtype", "--chat-template",
         "--enable-auto-tool-choice", "--tool-call-parser", "--distributed-executor-backend",
         "--memory-utilization", "--kv-cache-memory-bytes", "--kv-eviction", "--reasoning-parser",
         "--max-stored-responses", "--kv-offload-host-bytes", "--kv-offload-disk-path",
         "--kv-offload-disk-bytes", "--kv-offload-remote"]


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
