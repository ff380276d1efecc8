"""Prompt rendering: chat templates through the tokenizer's own jinja machinery.

Tools: a template that knows about tools gets them (and assistant `tool_calls`, `tool`
messages) as HF's `apply_chat_template` passes them. A template that never reads `tools`
(SmolLM2's, for one) would silently drop them, so the conversation is rewritten first in
the Hermes/Qwen2.5 form: the tools described in the system message, assistant calls as
`<tool_call>` blocks, tool results as `<tool_response>` blocks in user turns. The
server's `hermes` tool-call parser reads that format back.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import jinja2
from jinja2 import nodes

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FORMAT = (
    "</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def apply_chat_template(
    tokenizer,
    messages: Sequence[dict[str, Any]],
    chat_template: str | None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render a conversation to prompt text. Raises ValueError when no template exists.

    `tools` are OpenAI/HF function tools: `{"type": "function", "function": {"name",
    "description", "parameters"}}`; assistant messages may carry `tool_calls` (arguments
    as dicts) and `tool` messages a `tool_call_id`.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "this model has no chat template; pass chat_template= (a jinja string) or use generate()"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"message {i} is {m!r:.80}: each message needs a 'role'")
    messages = list(messages)
    if not template_reads_tools(template) and (tools or _has_tool_turns(messages)):
        messages, tools = hermes_tool_messages(messages, tools), None
    return tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tools=tools or None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )


@functools.lru_cache(maxsize=16)
def template_reads_tools(template: str) -> bool:
    """Whether the jinja template reads a variable named `tools` anywhere."""
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "tools" in template
    return any(n.name == "tools" for n in ast.find_all(nodes.Name))


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def hermes_tool_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation with tools, tool calls and tool results written out as text, in
    the Hermes/Qwen2.5 format, for a template that knows nothing of tools. Deterministic,
    so each turn's prompt extends the previous turn's (prefix-cache hits)."""
    out: list[dict[str, Any]] = []
    rest = messages
    if tools:
        described = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = f"{TOOLS_PREAMBLE}\n{described}\n{TOOLS_FORMAT}"
        if messages and messages[0].get("role") == "system":
            system = f"{_text(messages[0].get('content'))}\n\n{system}"
            rest = messages[1:]
        out.append({"role": "system", "content": system})
    for m in rest:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            parts = [_text(m.get("content"))] if _text(m.get("content")) else []
            for call in m["tool_calls"]:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                if isinstance(args, str):  # already JSON text
                    args = json.loads(args) if args.strip() else {}
                body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
                parts.append(f"<tool_call>\n{body}\n</tool_call>")
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            block = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({**m, "content": _text(m.get("content"))})
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
