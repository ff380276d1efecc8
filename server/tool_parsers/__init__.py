"""Tool-call parsers: turn a model's own tool-call format into OpenAI/Anthropic tool calls.

`get_tool_parser(name)` returns a parser class from the registry; `tool_parser_names()`
lists what `--tool-call-parser` accepts. Importing this package registers the built-in
parsers (`hermes`, `llama3_json`, `qwen3_coder`, `mistral`) through the same decorator outside ones would use.
"""

from tokenmill.server.tool_parsers import (  # noqa: F401  (registers)
    hermes,
    llama3_json,
    mistral,
    qwen3_coder,
)
from tokenmill.server.tool_parsers.base import (
    ContentDelta,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    get_tool_parser,
    new_tool_call_id,
    register_tool_parser,
    tool_parser_names,
)

__all__ = [
    "ContentDelta",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
    "new_tool_call_id",
    "register_tool_parser",
    "tool_parser_names",
]
