"""What the `tokenmill` command says about arguments it does not know: the nearest flag
of the subcommand when one is close (a typo, or another engine's spelling)."""

from __future__ import annotations

import argparse
import difflib


def subcommand_flags(parser: argparse.ArgumentParser, command: str) -> list[str]:
    """Every option string of `tokenmill COMMAND`."""
    for action in parser._subparsers._group_actions:  # argparse keeps subparsers there
        if command in action.choices:
            return [f for a in action.choices[command]._actions for f in a.option_strings]
    return []


def unknown_arguments(parser: argparse.ArgumentParser, command: str, rest: list[str]) -> str:
    """The error for arguments `tokenmill COMMAND` did not take: each unknown flag with the
    subcommand's nearest one, when one is near."""
    flags = subcommand_flags(parser, command)
    parts = []
    for arg in rest:
        if not arg.startswith("-"):
            continue
        name = arg.split("=", 1)[0]
        near = difflib.get_close_matches(name, flags, n=1, cutoff=0.75)
        parts.append(f"{name} (did you mean {near[0]}?)" if near else name)
    if not parts:
        return f"unrecognized arguments: {' '.join(rest)}"
    return f"unknown flag{'s' if len(parts) > 1 else ''} for `tokenmill {command}`: " + ", ".join(parts)
