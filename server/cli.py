"""The `tokenmill` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from tokenmill.platforms import template
from tokenmill.server import cli_client

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _platforms(args: argparse.Namespace) -> int:
    from tokenmill.platforms.registry import list_platforms

    infos = list_platforms()
    if args.json:
        print(json.dumps([_info_dict(i) for i in infos], indent=2))
        return 0
    if not infos:
        print("no platform plugin is installed; install one, e.g. `pip install plugins/cpu`")
        return 1
    for info in infos:
        state = "available" if info.available else "unavailable"
        print(f"{info.name}: {state} ({info.distribution} {info.version})")
        if info.reason:
            print(f"  reason: {info.reason}")
        if info.capabilities is not None:
            for key, value in _caps_dict(info.capabilities).items():
                print(f"  {key}: {value}")
    return 0


def _caps_dict(caps) -> dict[str, object]:
    out = {}
    for name in caps.__slots__:
        value = getattr(caps, name)
        if isinstance(value, frozenset):
            shown = [getattr(v, "value", v) for v in value]
            shown = [s if isinstance(s, int | str) else str(s).removeprefix("torch.") for s in shown]
            value = sorted(shown, key=lambda s: (isinstance(s, str), s))
        out[name] = value
    return out


def _info_dict(info) -> dict[str, object]:
    return {
        "name": info.name,
        "distribution": info.distribution,
        "version": info.version,
        "available": info.available,
        "reason": info.reason,
        "capabilities": None if info.capabilities is None else _caps_dict(info.capabilities),
    }


def _serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from tokenmill.async_engine import AsyncLLM
    from tokenmill.config import EngineArgs
    from tokenmill.server.app import build_app
    from tokenmill.server.http_server import uvicorn_options
    from tokenmill.server.reasoning import reasoning_parser_names
    from tokenmill.server.tool_parsers import tool_parser_names

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s"
    )
    if args.tool_call_parser is not None and args.tool_call_parser not in tool_parser_names():
        print(f"tokenmill serve: unknown --tool-call-parser {args.tool_call_parser!r}; "
              f"choose one of {tool_parser_names()}", file=sys.stderr)
        return 2
    if args.reasoning_parser is not None and args.reasoning_parser not in reasoning_parser_names():
        print(f"tokenmill serve: unknown --reasoning-parser {args.reasoning_parser!r}; "
              f"choose one of {reasoning_parser_names()}", file=sys.stderr)
        return 2
    chat_template = Path(args.chat_template).read_text() if args.chat_template else None
    engine_kw = {
        "model": args.model, "dtype": args.dtype, "platform": args.platform,
        "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "block_size": args.block_size,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "chat_template": chat_template, "seed": args.seed,
        "kv_offload_host_bytes": args.kv_offload_host_bytes,
        "kv_offload_disk_path": args.kv_offload_disk_path,
        "kv_offload_disk_bytes": args.kv_offload_disk_bytes,
        "kv_offload_remote": args.kv_offload_remote,
        "distributed_executor_backend": args.distributed_executor_backend,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel or None,
        "enable_sequence_parallelism": args.enable_sequence_parallelism or None,
        "decode_context_parallel_size": args.decode_context_parallel_size,
        "prefill_context_parallel_size": args.prefill_context_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "memory_utilization": args.memory_utilization,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "kv_eviction": args.kv_eviction,
        "generation_config": args.generation_config,
    }
    try:
        engine_args = EngineArgs(**{k: v for k, v in engine_kw.items() if v is not None})
    except ValidationError as e:
        print(f"tokenmill serve: invalid arguments:\n{e}", file=sys.stderr)
        return 2
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    api_key = args.api_key or os.environ.get("TOKENMILL_API_KEY") or None
    try:
        engine = AsyncLLM(engine_args, engine_process=True)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"tokenmill serve: the engine did not start: {e}", file=sys.stderr)
        return 1
    try:
        app = build_app(
            engine, names, api_key=api_key,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
            max_stored_responses=args.max_stored_responses,
            compact_json=args.structured_outputs_disable_any_whitespace,
        )
        server = uvicorn.Server(uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            **uvicorn_options(),  # httptools + uvloop
            timeout_graceful_shutdown=args.shutdown_timeout,
            log_level=args.log_level,
        ))
        # SIGINT/SIGTERM: uvicorn stops accepting, drains in-flight requests (the engine
        # process keeps stepping them), then the app's lifespan stops the engine process.
        server.run()
    finally:
        engine.shutdown()  # also when uvicorn stopped for another reason (a port in use)
    return 0 if server.started else 1


def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI and Anthropic HTTP APIs")
    p.add_argument("model", nargs="?", default=None,
                   help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: MODEL)")
    p.add_argument("--api-key", default=None,
                   help="require this key (also read from TOKENMILL_API_KEY)")
    p.add_argument("--platform", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most prompt tokens one request computes per step (0: no limit; "
                        "default: the platform's choice, 512 on CPU)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                   help="uni (default): the model runs in the engine's process; mp: a worker "
                        "process per rank; ray: a Ray actor per rank (joins the Ray cluster "
                        "RAY_ADDRESS names, or starts a local one)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="ranks the model is split over (default 1); > 1 runs the mp backend")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                   help="stages the model's layers are split over (default 1), each of "
                        "--tensor-parallel-size ranks; > 1 runs the mp backend")
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=None,
                   help="ranks each sequence's KV cache is spread over (x the tensor "
                        "parallel ones; default 1)")
    p.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=None,
                   help="ranks each prefill step's tokens are split over (x the tensor "
                        "parallel ones; default 1)")
    p.add_argument("--enable-sequence-parallelism", action="store_true",
                   help="with -tp > 1: activations split along the tokens between tensor "
                        "parallel regions (reduce-scatter + all-gather, not all-reduce)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: split the experts over the tensor parallel ranks "
                        "(all-to-all dispatch) instead of each expert's intermediate dim")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="engine replicas behind this server (default 1), each in its own "
                        "process with tp x pp ranks; requests go to the replica that served "
                        "their prefix, else the least loaded")
    p.add_argument("--memory-utilization", type=float, default=None,
                   help="share of the device memory the engine may use, KV cache included "
                        "(default 0.9; like vLLM's --gpu-memory-utilization)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache size in bytes (wins over --memory-utilization)")
    p.add_argument("--kv-eviction", choices=["benefit", "lru"], default=None,
                   help="which free cached KV pages go first under pressure: benefit (least "
                        "recompute saved per byte, the default) or lru (least recently freed)")
    p.add_argument("--dtype", default=None,
                   choices=["auto", "bfloat16", "bf16", "float32", "fp32", "float16", "fp16"])
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kv-offload-host-bytes", default=None, metavar="SIZE",
                   help="KV offload: host-memory tier size, e.g. 8GiB")
    p.add_argument("--kv-offload-disk-path", default=None, metavar="DIR",
                   help="KV offload: directory of the disk tier (reused across restarts)")
    p.add_argument("--kv-offload-disk-bytes", default=None, metavar="SIZE",
                   help="KV offload: disk tier size, e.g. 100GiB")
    p.add_argument("--kv-offload-remote", default=None, metavar="URL",
                   help="KV offload: remote tier, e.g. redis://127.0.0.1:6379")
    p.add_argument("--generation-config", default=None, metavar="auto|vllm|DIR",
                   help="default sampling parameters for requests that leave them unset: "
                   "'auto' (default) takes the model's generation_config.json, or tokenmill's "
                   "settings for the default model; 'vllm' (or 'none') turns them off; a "
                   "directory uses its generation_config.json")
    p.add_argument("--chat-template", default=None, help="a file holding a jinja chat template")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto": parse the model\'s own tool calls')
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the model's tool-call format for auto tool choice: hermes, llama3_json, "
                        "qwen3_coder or mistral (default: chosen from the chat template, logged)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split the model's thinking from its answer: qwen3 or deepseek_r1")
    p.add_argument("--structured-outputs-disable-any-whitespace", action="store_true",
                   help="JSON forced by tools and output formats has no optional whitespace "
                        "(small models may otherwise spend max_tokens on it)")
    p.add_argument("--max-stored-responses", type=int, default=1024,
                   help="responses the Responses API keeps for previous_response_id (LRU)")
    p.add_argument("--shutdown-timeout", type=int, default=30,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("platforms", help="list installed platform plugins and their state")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_platforms)
    _add_serve_parser(sub)
    cli_client.add_parsers(sub)  # chat, complete, bench serve
    template.add_parser(sub)  # tokenmill new-plugin NAME
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "bench", None) == "serve":  # its arguments are the load generator's
        args.bench_args = [*args.bench_args, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
