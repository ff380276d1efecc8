"""Reasoning parsers: split a reasoning model's thinking from its answer, as vLLM's
`--reasoning-parser`. Importing this package registers `qwen3` and `deepseek_r1`."""

from tokenmill.server.reasoning import think  # noqa: F401  (registers)
from tokenmill.server.reasoning.base import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

__all__ = [
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
    "reasoning_parser_names",
    "register_reasoning_parser",
]
