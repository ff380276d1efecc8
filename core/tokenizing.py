"""Prompt rendering: chat templates through the tokenizer's own jinja machinery."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def apply_chat_template(
    tokenizer,
    messages: Sequence[dict[str, Any]],
    chat_template: str | None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render a conversation to prompt text. Raises ValueError when no template exists."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "this model has no chat template; pass chat_template= (a jinja string) or use generate()"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"message {i} is {m!r:.80}: each message needs a 'role'")
    return tokenizer.apply_chat_template(
        list(messages),
        chat_template=template,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
