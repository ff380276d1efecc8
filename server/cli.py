"""The `tokenmill` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from tokenmill.platforms import template
from tokenmill.server import cli_client, cli_plan, router
from tokenmill.server.cli_flags import unknown_arguments

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


def _plugins(args: argparse.Namespace) -> int:
    """Every plugin of every kind on the one plugin manager: what it declares and provides."""
    from tokenmill.platforms.plugins import KINDS, PLATFORM, PluginError, PluginManager
    from tokenmill.platforms.registry import PlatformRegistry

    plugins = PluginManager.discover()
    platforms = {i.name: i for i in PlatformRegistry(plugins).list_platforms()}
    rows = []
    for kind in KINDS:
        for record in plugins.records(kind):
            row = {"kind": kind.name, "name": record.name, "distribution": record.distribution,
                   "version": record.version, "api_version": record.api_version,
                   "ok": record.plugin is not None, "detail": record.error}
            if record.plugin is not None and kind is PLATFORM:
                info = platforms[record.name]
                row["ok"] = info.available
                row["detail"] = f"{'available' if info.available else 'unavailable'}: {info.reason}"
            elif record.plugin is not None and kind.named_hook is not None:
                try:
                    call = plugins.caller(kind, record.name)
                    row["detail"] = ", ".join(sorted(call(kind.named_hook)))
                except PluginError as exc:
                    row["ok"], row["detail"] = False, str(exc)
            elif record.plugin is not None:
                row["detail"] = f"{type(record.plugin).__name__} {getattr(record.plugin, '__name__', '')}"
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for kind in KINDS:
        print(f"{kind.name} ({kind.entry_point_group}): {kind.summary}")
        for row in (r for r in rows if r["kind"] == kind.name):
            api = f"API {row['api_version']}" if row["api_version"] else "broken"
            print(f"  {row['name']}: {row['distribution']} {row['version']}, {api}; {row['detail']}")
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

    from tokenmill.engine.config import EngineArgs
    from tokenmill.frontend.async_engine import AsyncLLM
    from tokenmill.kv_connector.registry import parse_size
    from tokenmill.server.app import build_app
    from tokenmill.server.http_server import uvicorn_options
    from tokenmill.server.reasoning import get_reasoning_parser
    from tokenmill.server.tool_parsers import get_tool_parser

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s"
    )
    for flag, name, lookup in (("--tool-call-parser", args.tool_call_parser, get_tool_parser),
                               ("--reasoning-parser", args.reasoning_parser, get_reasoning_parser)):
        try:
            if name is not None:
                lookup(name)  # before the engine loads: a typo fails at once
        except ValueError as exc:
            print(f"tokenmill serve: {flag}: {exc}", file=sys.stderr)
            return 2
    if args.model and args.model_option and args.model != args.model_option:
        print(f"tokenmill serve: two models given ({args.model!r} and --model "
              f"{args.model_option!r}); serve one", file=sys.stderr)
        return 2
    model = args.model_option or args.model
    chat_template = Path(args.chat_template).read_text() if args.chat_template else None
    engine_kw = {
        "model": model, "dtype": args.dtype, "platform": args.platform,
        "quantization": args.quantization,
        "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "block_size": args.block_size,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "chat_template": chat_template, "seed": args.seed,
        "kv_offload_host_bytes": args.kv_offload_host_bytes,
        "kv_offload_disk_path": args.kv_offload_disk_path,
        "kv_offload_disk_bytes": args.kv_offload_disk_bytes,
        "kv_offload_remote": args.kv_offload_remote,
        "kv_offload_hmac_key": (args.kv_offload_hmac_key
                                or os.environ.get("TOKENMILL_KV_OFFLOAD_HMAC_KEY") or None),
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
        "kv_cache_dtype": args.kv_cache_dtype,
        "calculate_kv_scales": args.calculate_kv_scales or None,
        "enable_prefix_caching": args.enable_prefix_caching,
        "generation_config": args.generation_config,
        "speculative_config": args.speculative_config,
        "kv_role": args.kv_role, "kv_transport": args.kv_transport,
        "kv_lease_s": args.kv_lease_s,
    }
    try:
        engine_args = EngineArgs(**{k: v for k, v in engine_kw.items() if v is not None})
    except ValidationError as e:
        print(f"tokenmill serve: invalid arguments:\n{e}", file=sys.stderr)
        return 2
    try:
        stored_bytes = parse_size(args.max_stored_responses_bytes, "--max-stored-responses-bytes")
    except ValueError as e:
        print(f"tokenmill serve: {e}", file=sys.stderr)
        return 2
    names = args.served_model_name or [model or DEFAULT_MODEL_NAME]
    api_key = args.api_key or os.environ.get("TOKENMILL_API_KEY") or None
    admin_api_key = args.admin_api_key or os.environ.get("TOKENMILL_ADMIN_API_KEY") or None
    if args.enable_sleep_mode and not admin_api_key:
        print("tokenmill serve: --enable-sleep-mode needs --admin-api-key (or "
              "TOKENMILL_ADMIN_API_KEY): the sleep routes must not be open to every client",
              file=sys.stderr)
        return 2
    try:
        engine = AsyncLLM(engine_args, engine_process=True)
    except KeyboardInterrupt:
        print("tokenmill serve: interrupted while the engine was starting", file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError) as e:
        print(f"tokenmill serve: {e}", file=sys.stderr)
        return 1
    try:
        app = build_app(
            engine, names, api_key=api_key,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
            max_stored_responses=args.max_stored_responses,
            max_stored_response_bytes=stored_bytes,
            compact_json=args.structured_outputs_disable_any_whitespace,
            enable_sleep_mode=args.enable_sleep_mode, admin_api_key=admin_api_key,
            trust_request_chat_template=args.trust_request_chat_template,
            **({} if args.max_waiting_requests is None
               else {"max_waiting_requests": args.max_waiting_requests}),
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
        try:
            server.run()
        except KeyboardInterrupt:
            pass  # Ctrl-C: uvicorn drained and stopped, then re-raised SIGINT; nothing to add
    finally:
        engine.shutdown()  # also when uvicorn stopped for another reason (a port in use)
    return 0 if server.started else 1


def _add_serve_parser(sub) -> None:
    # no abbreviations: a typo is an error that names the nearest flag, never another flag
    p = sub.add_parser("serve", help="serve a model over the OpenAI and Anthropic HTTP APIs",
                       allow_abbrev=False)
    p.add_argument("model", nargs="?", default=None,
                   help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="the same as the positional MODEL (vLLM's spelling)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="a name clients use for the model (default: MODEL); repeat the flag "
                        "for several names")
    p.add_argument("--api-key", default=None,
                   help="require this key (also read from TOKENMILL_API_KEY)")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="serve POST /sleep, POST /wake_up and GET /is_sleeping, which change "
                        "the engine; they need --admin-api-key")
    p.add_argument("--admin-api-key", default=None,
                   help="the key the routes that change the engine require (also read from "
                        "TOKENMILL_ADMIN_API_KEY); a client key gets 403 there")
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
    p.add_argument("--memory-utilization", "--gpu-memory-utilization", type=float, default=None,
                   help="share of the device memory the engine may use, KV cache included "
                        "(default 0.9). On the CPU plugin the KV pool also stays within 10%% "
                        "of the machine's memory and 40%% of what is free, so the machine "
                        "stays usable ($TOKENMILL_CPU_KVCACHE_GIB or --kv-cache-memory-bytes "
                        "to change)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache size in bytes (wins over --memory-utilization)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="reuse the KV of shared prompt prefixes (default: on)")
    p.add_argument("--kv-eviction", choices=["benefit", "lru"], default=None,
                   help="which free cached KV pages go first under pressure: benefit (least "
                        "recompute saved per byte, the default) or lru (least recently freed)")
    p.add_argument("--dtype", default=None,
                   choices=["auto", "bfloat16", "bf16", "float32", "fp32", "float16", "fp16"])
    p.add_argument("--quantization", "-q", default=None,
                   choices=["none", "gguf", "awq", "gptq", "fp8"],
                   help="how the weights are held (vLLM's names): gguf, awq, gptq, fp8 keep the "
                        "checkpoint's quantized layers quantized, none dequantizes them "
                        "to --dtype; "
                        "default: what the checkpoint is (docs/quantization.md)")
    p.add_argument("--kv-cache-dtype", default=None,
                   choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="what the KV cache stores (vLLM's names): auto (the compute dtype, "
                        "the default) or FP8, twice the tokens in the same bytes; the "
                        "platform must support it (docs/quantized-kv.md)")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="with an FP8 --kv-cache-dtype: per-head KV scales from the amax "
                        "of a calibration prefill at start (a fixed stdlib sample) instead "
                        "of 1.0; checkpoint scales win; ignored with auto")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kv-offload-host-bytes", default=None, metavar="SIZE",
                   help="KV offload: host-memory tier size, e.g. 8GiB (default: no host "
                        "tier); it holds what the device pool evicts, so the two add up. "
                        "The CPU platform allows up to the memory available less a reserve "
                        "(10%% of the total, at most 2 GiB)")
    p.add_argument("--kv-offload-disk-path", default=None, metavar="DIR",
                   help="KV offload: directory of the disk tier (reused across restarts)")
    p.add_argument("--kv-offload-disk-bytes", default=None, metavar="SIZE",
                   help="KV offload: disk tier size, e.g. 100GiB")
    p.add_argument("--kv-offload-remote", default=None, metavar="URL",
                   help="KV offload: remote tier, e.g. redis://127.0.0.1:6379")
    p.add_argument("--kv-offload-hmac-key", default=None, metavar="KEY",
                   help="KV offload: objects in shared tiers (disk, remote) carry an "
                        "HMAC-SHA256 tag under this key (>= 16 bytes; also read from "
                        "TOKENMILL_KV_OFFLOAD_HMAC_KEY); a forged or untagged object is "
                        "never loaded")
    p.add_argument("--generation-config", default=None, metavar="auto|vllm|DIR",
                   help="default sampling parameters for requests that leave them unset: "
                   "'auto' (default) takes the model's generation_config.json, or tokenmill's "
                   "settings for the default model; 'vllm' (or 'none') turns them off; a "
                   "directory uses its generation_config.json")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s shape: \'{"method": "suffix", '
                   '"num_speculative_tokens": 8}\' (methods: suffix, ngram, mtp, eagle3 with "model": the head; docs/speculative.md)')
    p.add_argument("--kv-role", "--role", default=None, choices=["prefill", "decode", "both"],
                   help="prefill/decode disaggregation (docs/disaggregation.md): prefill "
                        "computes prompts and holds their KV for decode instances, decode "
                        "continues them from the pulled KV; both (default) serves colocated. "
                        "Put `tokenmill router` in front")
    p.add_argument("--kv-transport", default=None, metavar="NAME",
                   help="the KV transport plugin for handovers: nixl or mooncake (default: "
                        "the first installed of mooncake, nixl)")
    p.add_argument("--kv-lease-s", type=float, default=None, metavar="SECONDS",
                   help="how long a prefill instance holds a prompt's KV for its decode "
                        "instance (default 30)")
    p.add_argument("--chat-template", default=None, help="a file holding a jinja chat template")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a `chat_template` in chat requests (a template is code: only "
                        "for clients you trust); without it such a request is a 400")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction,
                   default=True,
                   help='serve tool_choice "auto", parsing the model\'s own tool calls (on by '
                        "default: agents send it with every request that has tools)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the model's tool-call format for auto tool choice: hermes, llama3_json, "
                        "qwen3_coder, mistral or json (default: chosen from the chat template, "
                        "logged; json, the generic parser, when it shows no known format)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split the model's thinking from its answer: qwen3 or deepseek_r1")
    p.add_argument("--structured-outputs-disable-any-whitespace", action="store_true",
                   help="JSON forced by tools and output formats has no optional whitespace "
                        "(small models may otherwise spend max_tokens on it)")
    p.add_argument("--max-stored-responses", type=int, default=1024,
                   help="responses the Responses API keeps for previous_response_id (LRU)")
    p.add_argument("--max-stored-responses-bytes", default="256MiB", metavar="SIZE",
                   help="bytes (their JSON) the Responses API's stored responses may hold in "
                        "all, e.g. 256MiB; the least recently used go first")
    p.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                   help="sequences that may wait for the engine beyond those it runs (default "
                        "64: a full queue of the default model drains in about a minute on a "
                        "2-core CPU); more are answered 429 with Retry-After")
    p.add_argument("--shutdown-timeout", type=int, default=30,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--log-level", "--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("platforms", help="list installed platform plugins and their state")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_platforms)
    p = sub.add_parser("plugins", help="list every installed plugin of every kind (platforms, "
                       "KV tiers, tool and reasoning parsers), its API version and state")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_plugins)
    _add_serve_parser(sub)
    cli_client.add_parsers(sub)  # chat, complete, bench serve
    template.add_parser(sub)  # tokenmill new-plugin NAME
    cli_plan.add_parser(sub)  # tokenmill plan
    router.add_parser(sub)  # tokenmill router (prefill/decode disaggregation)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "bench", None) == "serve":  # its arguments are the load generator's
        args.bench_args = [*args.bench_args, *rest]
    elif rest:
        parser.error(unknown_arguments(parser, args.command, rest))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
