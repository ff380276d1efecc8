"""The reasoning-parser contract (the `reasoning_parser` plugin kind) and the stream every
parser shares.

A parser names the markers around a model's thinking (`<think>` ... `</think>`) and
whether an output starts inside its thinking. `ReasoningStream` applies that to an
output as it grows; a complete output is the same stream fed once, so a streamed answer
and a whole one always split the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tokenmill.platforms.tool_parsing import partial_marker_start


class ReasoningParser:
    """Where a model's thinking is: between `start_token` and `end_token`.

    `starts_in_reasoning(prompt)`: whether the output begins inside the thinking before
    any marker is written (the chat template opened it in the prompt, or the model family
    always thinks first). An output may also open it with `start_token` (after blanks).
    """

    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"

    def starts_in_reasoning(self, prompt: str) -> bool:
        raise NotImplementedError

    def stream(self, prompt: str) -> ReasoningStream:
        return ReasoningStream(self, self.starts_in_reasoning(prompt))

    def extract(self, prompt: str, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a complete output `text` to `prompt`."""
        s = self.stream(prompt)
        pieces = s.feed(text) + s.finish()
        reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningDelta))
        content = "".join(p.text for p in pieces if not isinstance(p, ReasoningDelta))
        return (reasoning if s.saw_reasoning else None), content


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class AnswerDelta:
    """Text after the thinking (what the tool-call parser reads next)."""

    text: str


class ReasoningStream:
    """One output's text deltas in, `ReasoningDelta`s then `AnswerDelta`s out.

    States: `undecided` (only blanks or a prefix of `start_token` so far), `reasoning`,
    `answer`. A partial marker at the end of the text is held until the next delta
    decides it. The markers themselves are never emitted; blanks right after the end
    marker are dropped (models write `</think>\\n\\n` before the answer).
    """

    def __init__(self, parser: ReasoningParser, in_reasoning: bool) -> None:
        self.parser = parser
        self.state = "reasoning" if in_reasoning else "undecided"
        self.saw_reasoning = in_reasoning
        self.lead = in_reasoning  # a start marker may still open the (already open) thinking
        self.pending = ""  # text not yet emitted
        self.trim_lead = False  # drop blanks at the start of the answer

    def feed(self, delta: str) -> list[ReasoningDelta | AnswerDelta]:
        self.pending += delta
        return self._drain(final=False)

    def finish(self) -> list[ReasoningDelta | AnswerDelta]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[ReasoningDelta | AnswerDelta]:
        out: list[ReasoningDelta | AnswerDelta] = []
        start, end = self.parser.start_token, self.parser.end_token
        while self.pending:
            if self.state == "undecided":
                head = self.pending.lstrip()
                if head.startswith(start):
                    self.pending = head[len(start):]
                    self.state, self.saw_reasoning = "reasoning", True
                elif start.startswith(head) and not final:
                    break  # blanks, or what could still become the start marker
                else:
                    self.state = "answer"
            elif self.state == "reasoning" and self.lead:
                head = self.pending.lstrip()
                if head.startswith(start):
                    self.pending = head[len(start):]
                elif head and start.startswith(head) and not final:
                    break
                if head:
                    self.lead = False
                elif not final:
                    break
                else:
                    self.lead = False
            elif self.state == "reasoning":
                i = self.pending.find(end)
                if i >= 0:
                    if i:
                        out.append(ReasoningDelta(self.pending[:i]))
                    self.pending = self.pending[i + len(end):]
                    self.state, self.trim_lead = "answer", True
                    continue
                j = None if final else partial_marker_start(self.pending, end)
                cut = len(self.pending) if j is None else j
                if cut:
                    out.append(ReasoningDelta(self.pending[:cut]))
                self.pending = self.pending[cut:]
                break
            else:
                if self.trim_lead:
                    self.pending = self.pending.lstrip()
                    if not self.pending:
                        break
                    self.trim_lead = False
                out.append(AnswerDelta(self.pending))
                self.pending = ""
        return out
