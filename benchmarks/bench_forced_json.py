"""Does forced JSON end? SmolLM2-135M at its default sampling (temperature 0.2, top_p 0.9),
asked for the weather in Paris with a `get_weather(city)` tool, the call forced by a named
tool choice (the output is the arguments) and by `required` (`{"name", "arguments"}`),
`--seeds` samples each, all in one batch:

- before: the schema as given (objects open to other keys) and llguidance's unbounded
  whitespace (what the server forced before issue 23);
- now: the server's closed schema (server/closed_schema.py) and the core's bounded
  whitespace (`BOUNDED_JSON_WHITESPACE`).

    python benchmarks/bench_forced_json.py [--seeds 8] [--max-tokens 100]

Prints a Markdown table (docs/server.md).
"""

from __future__ import annotations

import argparse
import json

from tokenmill import LLM, SamplingParams
from tokenmill.server.closed_schema import close_objects
from tokenmill.structured import StructuredOutputsParams

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
          "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                            "parameters": PARAMS}}]
CONV = [{"role": "user", "content": "What is the weather in Paris?"}]
UNBOUNDED = {"whitespace_flexible": True, "whitespace_pattern": "[\\x20\\x0A\\x0D\\x09]+"}


def forced(mode: str, arguments: dict) -> dict:
    if mode == "named":
        return arguments
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": "get_weather"},
                                                        "arguments": arguments},
                       "required": ["name", "arguments"], "additionalProperties": False}]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=100)
    args = ap.parse_args()
    llm = LLM(num_kv_blocks=2048)
    cases, params = [], []
    for when in ("before", "now"):
        for mode in ("named", "required"):
            schema = forced(mode, PARAMS if when == "before" else close_objects(PARAMS))
            if when == "before":
                schema = {**schema, "x-guidance": UNBOUNDED}
            for seed in range(args.seeds):
                cases.append((when, mode))
                params.append(SamplingParams(
                    max_tokens=args.max_tokens, seed=seed, temperature=0.2, top_p=0.9,
                    structured_outputs=StructuredOutputsParams(json=schema)))
    outs = llm.chat([CONV] * len(cases), params, use_tqdm=False, tools=TOOLS)
    tally: dict[tuple[str, str], list[int]] = {}
    for case, out in zip(cases, outs):
        o = out.outputs[0]
        try:
            json.loads(o.text)
            ok = 1
        except json.JSONDecodeError:
            ok = 0
        t = tally.setdefault(case, [0, 0])
        t[0] += ok
        t[1] += len(o.token_ids)
    print("| forced call | before: parsed, mean tokens | now: parsed, mean tokens |")
    print("|---|---|---|")
    for mode in ("named", "required"):
        b, n = tally[("before", mode)], tally[("now", mode)]
        print(f"| {mode} | {b[0]} / {args.seeds}, {b[1] / args.seeds:.0f} | "
              f"{n[0]} / {args.seeds}, {n[1] / args.seeds:.0f} |")


if __name__ == "__main__":
    main()
