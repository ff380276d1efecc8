"""`tokenmill chat`, `tokenmill complete` and `tokenmill bench serve`: clients of a running
server (as vLLM's commands), through the `openai` SDK and the serving load generator
(`tokenmill.server.bench`). Both ship in the base install."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

DEFAULT_URL = "http://127.0.0.1:8000/v1"


def _client(args: argparse.Namespace):
    import openai

    key = args.api_key or os.environ.get("TOKENMILL_API_KEY") or os.environ.get("OPENAI_API_KEY")
    client = openai.OpenAI(base_url=args.url, api_key=key or "EMPTY", max_retries=0)
    model = args.model or client.models.list().data[0].id
    return client, model


def _say(stream, out) -> str:
    """Print a streamed chat or completion answer as it comes; returns its text."""
    parts = []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        piece = choice.delta.content if hasattr(choice, "delta") else choice.text
        if piece:
            parts.append(piece)
            out.write(piece)
            out.flush()
    out.write("\n")
    return "".join(parts)


def _chat(args: argparse.Namespace) -> int:
    client, model = _client(args)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    turns = [args.quick] if args.quick is not None else None
    while True:
        if turns is not None:
            if not turns:
                return 0
            text = turns.pop(0)
        else:
            try:
                text = input("> ")
            except EOFError:
                return 0
        messages.append({"role": "user", "content": text})
        stream = client.chat.completions.create(
            model=model, messages=messages, stream=True, max_tokens=args.max_tokens,
            temperature=args.temperature)
        messages.append({"role": "assistant", "content": _say(stream, sys.stdout)})


def _complete(args: argparse.Namespace) -> int:
    client, model = _client(args)
    prompts = [args.quick] if args.quick is not None else None
    while True:
        if prompts is not None:
            if not prompts:
                return 0
            prompt = prompts.pop(0)
        else:
            try:
                prompt = input("> ")
            except EOFError:
                return 0
        stream = client.completions.create(model=model, prompt=prompt, stream=True,
                                           max_tokens=args.max_tokens,
                                           temperature=args.temperature)
        _say(stream, sys.stdout)


def _bench_serve(args: argparse.Namespace) -> int:
    from tokenmill.server.bench.serve import main as bench_main

    return bench_main(args.bench_args)


def _one_line_errors(command: str, run: Callable[[argparse.Namespace], int]):
    """A refused connection or an error answer is one line on stderr, never a traceback."""

    def wrapped(args: argparse.Namespace) -> int:
        import openai

        try:
            return run(args)
        except openai.APIConnectionError:
            print(f"tokenmill {command}: no server answers at {args.url}; start one with "
                  "`tokenmill serve`, or pass --url", file=sys.stderr)
        except openai.APIStatusError as e:
            print(f"tokenmill {command}: the server at {args.url} answered {e.status_code}: "
                  f"{_error_text(e)}", file=sys.stderr)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        return 1

    return wrapped


def _error_text(e) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    inner = body.get("error", body)
    return inner.get("message", e.message) if isinstance(inner, dict) else str(e.message)


def _client_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"the server's OpenAI base URL ({DEFAULT_URL})")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None,
                   help="API key (default: TOKENMILL_API_KEY or OPENAI_API_KEY)")
    p.add_argument("-q", "--quick", default=None, metavar=what.upper(),
                   help=f"send one {what}, print the answer and exit (default: read lines from stdin)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)


def add_parsers(sub) -> None:
    p = sub.add_parser("chat", help="chat with a running server")
    _client_args(p, "message")
    p.add_argument("--system-prompt", default=None)
    p.set_defaults(func=_one_line_errors("chat", _chat))
    p = sub.add_parser("complete", help="complete prompts on a running server")
    _client_args(p, "prompt")
    p.set_defaults(func=_one_line_errors("complete", _complete))
    p = sub.add_parser("bench", help="benchmarks against a running server")
    bench = p.add_subparsers(dest="bench", required=True)
    serve = bench.add_parser("serve", help="load-test a running server (tokenmill.server.bench)",
                             add_help=False)
    # every argument goes to tokenmill.server.bench.serve (its --help lists them)
    serve.set_defaults(func=_bench_serve, bench_args=[])
