"""The Responses API's answer shapes, as pydantic models for the OpenAPI schema (the
route builds plain dicts; the schemathesis test checks answers against these)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    content: list[ReasoningText]
    status: ItemStatus


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: ItemStatus


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: float
    completed_at: float | None = None
    status: Literal["completed", "incomplete", "in_progress"]
    background: bool
    error: None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[OutputMessage | OutputReasoning | OutputFunctionCall]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None
    user: str | None
