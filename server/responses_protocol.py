"""Request body of the OpenAI Responses API (`POST /v1/responses`), with the same hard
limits as the other routes (server/protocol.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from tokenmill.server.protocol import (
    _SEED_MAX,
    MAX_TOOLS,
    FreeStr,
    IdStr,
    StopStr,
    ToolName,
    _Body,
    _Request,
)

MAX_ITEMS = 4096  # input items per request


class InputText(_Body):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str


class Refusal(_Body):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | Refusal, Field(discriminator="type")]


class MessageItem(_Body):
    """An easy input message, an input message or an earlier output message."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: IdStr | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, InputText) else p.refusal for p in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: IdStr
    arguments: str  # a JSON object, as text
    id: IdStr | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[InputText]
    id: IdStr | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    id: IdStr | None = None
    summary: list[InputText] = Field(default_factory=list)
    content: list[InputText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or [])


def _item_kind(v: Any) -> str:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: IdStr


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: IdStr | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    model: IdStr | None = None
    input: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS)]
    )
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=256)
    store: bool = True
    stream: bool | None = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512
    metadata: dict[Annotated[str, Field(max_length=64)], FreeStr] | None = Field(None, max_length=16)
    user: FreeStr | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    seed: int | None = Field(None, ge=0, le=_SEED_MAX)
    stop: StopStr | list[StopStr] | None = Field(None, max_length=16)
    cache_salt: str | None = Field(None, max_length=1024)
