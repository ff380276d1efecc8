"""What a request's output must match: vLLM's `StructuredOutputsParams`, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputError(ValueError):
    """A request's structured output constraint cannot be used: its schema, regex or grammar
    is invalid, or compiling it exceeded the time or size bound. Raised by
    `LLMEngine.add_request` for that request only; the engine keeps serving the others."""


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrains the output of a request. Exactly one of the five constraints is set.

    - `json`: a JSON schema (a dict, or its JSON text); the output is one JSON value valid
      against it.
    - `json_object`: any JSON object.
    - `regex`: the whole output matches this regular expression (Rust `regex` syntax; no
      backreferences or lookaround, so matching never backtracks).
    - `choice`: the output is exactly one of these strings.
    - `grammar`: a context-free grammar in llguidance's Lark syntax, e.g.
      `start: "yes" | "no"`.

    `disable_any_whitespace`: JSON without optional whitespace (compact separators).
    Construction raises `ValueError` naming the fields when not exactly one is set.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        chosen = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            got = ", ".join(f"{k}={getattr(self, k)!r:.60}" for k in chosen) or "none"
            raise ValueError(
                f"StructuredOutputsParams needs exactly one of {', '.join(_KINDS)}; got {got}"
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError(
                f"StructuredOutputsParams.json={self.json!r:.60}: give a JSON schema as a dict "
                "or as JSON text"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(f"StructuredOutputsParams.json_object={self.json_object!r}: must be a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name}={value!r:.60}: must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise ValueError(
                    f"StructuredOutputsParams.choice={self.choice!r:.60}: must be a non-empty "
                    "list of non-empty strings"
                )
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        """Which constraint is set: 'json', 'json_object', 'regex', 'choice' or 'grammar'."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))
