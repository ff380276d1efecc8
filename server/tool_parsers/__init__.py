"""Tool-call parsers: turn a model's own tool-call format into OpenAI/Anthropic tool calls.

Parsers are the `tool_parser` plugin kind (tokenmill.platforms.plugins). The built-in ones
(`hermes`, `llama3_json`, `qwen3_coder`, `mistral`, and the generic `json` for models
with no known format) are this module's hooks, announced in
the core's pyproject.toml (entry point group `tokenmill.tool_parsers`) and found, like an
outside plugin's, by `installed_tool_parsers()`; `get_tool_parser(name)` picks one. The
parser contract itself is `tokenmill.platforms.tool_parsing`.
"""

from __future__ import annotations

import pluggy

from tokenmill.platforms.plugins import TOOL_PARSER, PluginManager
from tokenmill.platforms.tool_parsing import ToolParser
from tokenmill.server.tool_parsers.generic_json import GenericJsonToolParser
from tokenmill.server.tool_parsers.hermes import HermesToolParser
from tokenmill.server.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenmill.server.tool_parsers.mistral import MistralToolParser
from tokenmill.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

hookimpl = pluggy.HookimplMarker("tokenmill")


@hookimpl
def tokenmill_api_version() -> str:
    return "1.6"


@hookimpl
def tokenmill_tool_parsers() -> dict[str, type[ToolParser]]:
    return {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
            "qwen3_coder": Qwen3CoderToolParser, "mistral": MistralToolParser,
            "json": GenericJsonToolParser}


def _check(name: str, parser: object) -> str | None:
    if isinstance(parser, type) and issubclass(parser, ToolParser):
        return None
    return f"is {parser!r}, not a ToolParser subclass"


def installed_tool_parsers(plugins: PluginManager | None = None) -> dict[str, type[ToolParser]]:
    """Every installed tool parser by name (the core's and the plugins')."""
    plugins = plugins if plugins is not None else PluginManager.discover([TOOL_PARSER])
    return {name: parser for name, (_, parser) in
            plugins.named(TOOL_PARSER, "tokenmill_tool_parsers", _check).items()}


def get_tool_parser(name: str, plugins: PluginManager | None = None) -> type[ToolParser]:
    """The parser `--tool-call-parser name` means; ValueError listing the names if none."""
    parsers = installed_tool_parsers(plugins)
    if name not in parsers:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(parsers)}")
    return parsers[name]
