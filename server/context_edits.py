"""Anthropic's `context_management` edits on a conversation in HF chat form (see
server/chat.py): `clear_thinking_20251015` and `clear_tool_uses_20250919`.

Both only shorten the prompt; the response reports what was applied under
`context_management.applied_edits`, as Anthropic's API does.
"""

from __future__ import annotations

from typing import Any

from tokenmill.server.protocol import AnthropicClearThinking, AnthropicClearToolUses

Message = dict[str, Any]

CLEARED = "[tool result cleared to save context]"
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING_TURNS = 1


def clear_thinking(conv: list[Message], edit: AnthropicClearThinking) -> dict[str, Any] | None:
    """Drop `reasoning_content` from all but the last kept assistant turns that have it
    (in place); the applied edit, or None when nothing was cleared."""
    if edit.keep == "all":
        return None
    keep = DEFAULT_KEEP_THINKING_TURNS if edit.keep is None else edit.keep.value
    thinking = [m for m in conv if m.get("role") == "assistant" and m.get("reasoning_content")]
    dropped = thinking[:max(len(thinking) - keep, 0)]
    for m in dropped:
        del m["reasoning_content"]
    if not dropped:
        return None
    return {"type": edit.type, "cleared_thinking_turns": len(dropped)}


def tool_uses_trigger(edit: AnthropicClearToolUses) -> int:
    """The prompt length (tokens) from which `edit` clears tool results."""
    return DEFAULT_TRIGGER_TOKENS if edit.trigger is None else edit.trigger.value


def clear_tool_uses(conv: list[Message], edit: AnthropicClearToolUses) -> dict[str, Any] | None:
    """Replace the results of all but the last kept tool uses with a placeholder (in place;
    the caller checked the trigger); the applied edit, or None when nothing was cleared."""
    keep = DEFAULT_KEEP_TOOL_USES if edit.keep is None else edit.keep.value
    excluded = set(edit.exclude_tools or ())
    names = {
        call["id"]: call["function"]["name"]
        for m in conv if m.get("role") == "assistant"
        for call in m.get("tool_calls") or ()
    }
    results = [m for m in conv if m.get("role") == "tool"
               and names.get(m.get("tool_call_id")) not in excluded]
    cleared = [m for m in results[:max(len(results) - keep, 0)] if m["content"] != CLEARED]
    ids = {m.get("tool_call_id") for m in cleared}
    for m in cleared:
        m["content"] = CLEARED
    if edit.clear_tool_inputs:
        for m in conv:
            for call in m.get("tool_calls") or ():
                if call["id"] in ids:
                    call["function"]["arguments"] = {}
    if not cleared:
        return None
    return {"type": edit.type, "cleared_tool_uses": len(cleared)}
