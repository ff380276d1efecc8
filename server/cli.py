"""The `tokenmill` command line."""

from __future__ import annotations

import argparse
import json
import sys


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("platforms", help="list installed platform plugins and their state")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_platforms)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
