"""The `<think>` ... `</think>` families.

| name | output begins | unclosed thinking |
|---|---|---|
| `qwen3` | inside the thinking when the rendered prompt ends with `<think>` (Qwen3-Thinking templates, `enable_thinking`), else only if the output writes `<think>` | all reasoning (cut by max_tokens) |
| `deepseek_r1` | inside the thinking (R1 templates open it in the prompt; a leading `<think>` is skipped) | all reasoning |
"""

from __future__ import annotations

from tokenmill.platforms.reasoning import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    def starts_in_reasoning(self, prompt: str) -> bool:
        return prompt.rstrip().endswith(self.start_token)


class DeepSeekR1ReasoningParser(ReasoningParser):
    def starts_in_reasoning(self, prompt: str) -> bool:
        return True
