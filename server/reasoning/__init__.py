"""Reasoning parsers: split a reasoning model's thinking from its answer, as vLLM's
`--reasoning-parser`.

Parsers are the `reasoning_parser` plugin kind (tokenmill.platforms.plugins). The built-in
ones (`qwen3`, `deepseek_r1`) are this module's hooks, announced in the core's
pyproject.toml (entry point group `tokenmill.reasoning_parsers`) and found, like an
outside plugin's, by `installed_reasoning_parsers()`. The parser contract itself is
`tokenmill.platforms.reasoning`.
"""

from __future__ import annotations

import pluggy

from tokenmill.platforms.plugins import REASONING_PARSER, PluginManager
from tokenmill.platforms.reasoning import ReasoningParser
from tokenmill.server.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

hookimpl = pluggy.HookimplMarker("tokenmill")


@hookimpl
def tokenmill_api_version() -> str:
    return "1.6"


@hookimpl
def tokenmill_reasoning_parsers() -> dict[str, type[ReasoningParser]]:
    return {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}


def _check(name: str, parser: object) -> str | None:
    if isinstance(parser, type) and issubclass(parser, ReasoningParser):
        return None
    return f"is {parser!r}, not a ReasoningParser subclass"


def installed_reasoning_parsers(
    plugins: PluginManager | None = None,
) -> dict[str, type[ReasoningParser]]:
    """Every installed reasoning parser by name (the core's and the plugins')."""
    plugins = plugins if plugins is not None else PluginManager.discover([REASONING_PARSER])
    return {name: parser for name, (_, parser) in
            plugins.named(REASONING_PARSER, "tokenmill_reasoning_parsers", _check).items()}


def get_reasoning_parser(
    name: str, plugins: PluginManager | None = None,
) -> type[ReasoningParser]:
    """The parser `--reasoning-parser name` means; ValueError listing the names if none."""
    parsers = installed_reasoning_parsers(plugins)
    if name not in parsers:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(parsers)}")
    return parsers[name]
