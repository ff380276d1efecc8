"""Conversations from the OpenAI and Anthropic request shapes into HF chat messages (the
form chat templates read), and their rendering with tools.

Both APIs land on one form: assistant messages carry `tool_calls` with `arguments` as a
dict (what HF templates index into), tool results are `{"role": "tool", "tool_call_id",
"content"}` messages.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any

import jinja2

from tokenmill.frontend.async_engine import AsyncLLM
from tokenmill.frontend.tokenizing import hermes_tool_messages, template_reads_tools
from tokenmill.server.protocol import (
    AnthropicText,
    AnthropicThinking,
    AnthropicToolResult,
    AnthropicToolUse,
    ChatCompletionRequest,
    ChatMessage,
)
from tokenmill.server.render import RenderLimitError, max_prompt_chars
from tokenmill.server.serving import APIError, ServerState

logger = logging.getLogger("tokenmill.server")

Message = dict[str, Any]


def _arguments(text: str, where: str) -> dict[str, Any]:
    try:
        args = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise APIError(400, f"{where}.function.arguments is not valid JSON: {e}", "messages") from e
    if not isinstance(args, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object, got {text!r:.80}",
                       "messages")
    return args


def _openai_message(i: int, m: ChatMessage) -> Message:
    msg: Message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.role == "assistant" and m.reasoning_content:
        msg["reasoning_content"] = m.reasoning_content
    if m.name is not None:
        msg["name"] = m.name
    if m.role == "assistant" and m.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name,
                          "arguments": _arguments(c.function.arguments, f"messages.{i}.tool_calls.{j}")}}
            for j, c in enumerate(m.tool_calls)
        ]
    if m.role == "tool":
        if not m.tool_call_id:
            raise APIError(400, f"messages.{i}: a tool message needs tool_call_id", "messages")
        msg["tool_call_id"] = m.tool_call_id
    return msg


def openai_messages(body: ChatCompletionRequest) -> list[Message]:
    return [_openai_message(i, m) for i, m in enumerate(body.messages)]


def openai_tools(body: ChatCompletionRequest) -> list[Message] | None:
    if not body.tools:
        return None
    return [
        {"type": "function", "function": {
            "name": t.function.name,
            "description": t.function.description or "",
            "parameters": t.function.parameters or {"type": "object", "properties": {}},
        }}
        for t in body.tools
    ]


def anthropic_messages(body) -> list[Message]:
    """The conversation of a Messages request: tool_use blocks become assistant tool_calls,
    tool_result blocks `tool` messages (ahead of the user's text in the same turn)."""
    conv: list[Message] = []
    system = body.system_text()
    if system:
        conv.append({"role": "system", "content": system})
    for m in body.messages:
        if isinstance(m.content, str) or m.role == "system":
            conv.append({"role": m.role, "content": m.text()})
            continue
        text = "".join(b.text for b in m.content if isinstance(b, AnthropicText))
        if m.role == "assistant":
            msg: Message = {"role": "assistant", "content": text}
            thinking = "".join(b.thinking for b in m.content if isinstance(b, AnthropicThinking))
            if thinking:
                msg["reasoning_content"] = thinking
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                for b in m.content if isinstance(b, AnthropicToolUse)
            ]
            if calls:
                msg["tool_calls"] = calls
            conv.append(msg)
            continue
        for b in m.content:
            if isinstance(b, AnthropicToolResult):
                result = b.text()
                conv.append({"role": "tool", "tool_call_id": b.tool_use_id,
                             "content": f"Error: {result}" if b.is_error else result})
        if text or not any(isinstance(b, AnthropicToolResult) for b in m.content):
            conv.append({"role": "user", "content": text})
    return conv


def anthropic_tools(body) -> list[Message] | None:
    """The client tools the model is shown: deferred tools (`defer_loading`, loaded on
    demand through tool search) and Anthropic's own typed tools are left out."""
    if not body.tools:
        return None
    typed = [t.name for t in body.tools if not t.is_custom]
    if typed:
        logger.info("tools %s are Anthropic's own typed tools, which this server does not "
                    "run; the model is not shown them", typed)
    return [
        {"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema,
        }}
        for t in body.tools if t.is_custom and not t.defer_loading
    ] or None


def served_template(engine: AsyncLLM) -> str | None:
    """The chat template the server renders with: `--chat-template`, else the model's."""
    return engine.chat_template


def _render(tokenizer, messages: list[Message], template: str | None,
            tools: list[Message] | None, template_kwargs: dict[str, Any]) -> str:
    """`tokenmill.frontend.tokenizing.apply_chat_template` with extra template variables (vLLM's
    `chat_template_kwargs`: `enable_thinking`, `reasoning_effort`, ...)."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model has no chat template; use /v1/completions")
    has_tool_turns = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if not template_reads_tools(template) and (tools or has_tool_turns):
        messages, tools = hermes_tool_messages(messages, tools), None
    reserved = {"messages", "tools", "chat_template", "add_generation_prompt", "tokenize"}
    extra = {k: v for k, v in template_kwargs.items() if k not in reserved}
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tools=tools or None, add_generation_prompt=True,
        tokenize=False, **extra,
    )


def _late_system(messages: list[Message]) -> list[Message]:
    """System messages after the first other message (mid-conversation system turns)."""
    first = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    return [m for m in messages[first:] if m.get("role") == "system"]


def fold_system(messages: list[Message]) -> list[Message]:
    """The conversation with every system message joined into one leading system prompt,
    for templates that refuse (or drop) system messages anywhere else."""
    system = [m for m in messages if m.get("role") == "system"]
    if not system:
        return messages
    text = "\n\n".join(m["content"] for m in system if m.get("content"))
    return [{"role": "system", "content": text}, *(m for m in messages if m.get("role") != "system")]


def _render_placing_system(tokenizer, messages: list[Message], template: str | None,
                           tools: list[Message] | None, template_kwargs: dict[str, Any]) -> str:
    """`_render`, with mid-conversation system messages where they are when the template
    renders them there, else folded into the system prompt."""
    late = _late_system(messages)
    if not late:
        return _render(tokenizer, messages, template, tools, template_kwargs)
    try:
        text = _render(tokenizer, messages, template, tools, template_kwargs)
    except (jinja2.TemplateError, TypeError, ValueError):
        text = None
    if text is not None and all(m["content"].strip() in text for m in late):
        return text
    return _render(tokenizer, fold_system(messages), template, tools, template_kwargs)


async def render_chat(
    state: ServerState,
    messages: list[Message],
    chat_template: str | None = None,
    tools: list[Message] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """(prompt text, token ids), on the server's render pool (time-limited); a template
    that refuses the conversation, runs too long or writes too long a prompt is a 400.
    `template_kwargs` are extra variables for the template."""
    engine = state.engine
    template = chat_template or served_template(engine)
    limit = max_prompt_chars(engine.max_model_len)

    def render() -> str:
        try:
            text = _render_placing_system(engine.tokenizer, messages, template, tools,
                                          template_kwargs or {})
        except (jinja2.TemplateError, TypeError, RecursionError) as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from e
        if len(text) > limit:
            raise RenderLimitError(f"the rendered prompt has {len(text)} characters, over the "
                                   f"limit of {limit} for a {engine.max_model_len}-token context")
        return text

    param = "chat_template" if chat_template is not None else "messages"
    text = await state.run_render(render, param=param)  # a template's loops: time-limited
    ids = await state.run_render(partial(engine.tokenizer.encode, text, add_special_tokens=False),
                                 "tokenizing the prompt", param, timed=False)
    return text, ids
