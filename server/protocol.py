"""Request bodies of the OpenAI and Anthropic APIs, as pydantic models with hard limits.

Unknown top-level fields of a request are logged and ignored, as vLLM does (SDKs send
fields we do not use; nested unknown fields are ignored); NaN and infinities are
rejected everywhere; every number that reaches the engine is bounded here so that no
schema-valid request can make the server fail.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger("tokenmill.server")

MAX_N = 16  # completions per request
MAX_LOGPROBS = 20  # top logprobs per token
MAX_STOP = 16  # stop strings per request
MAX_STOP_LEN = 256  # characters per stop string
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_TOOLS = 128  # tools per request
MAX_LOGIT_BIAS = 1024  # biased tokens per request
MAX_BODY_BYTES = 4 << 20
MAX_HEADER_BYTES = 16 << 10
# The HTTP parser's own bound on a request head it is still reading: above MAX_HEADER_BYTES,
# so that heads up to it reach the app whole (and get its 431) however TCP splits them.
MAX_HTTP_HEAD_BYTES = 4 * MAX_HEADER_BYTES
_SEED_MAX = (1 << 63) - 1 - MAX_N  # seed + i (i < n) must stay a valid torch seed
_TOKEN_ID_MAX = (1 << 31) - 1

MAX_JSON_DEPTH = 64  # objects and lists within each other, anywhere in a body
MAX_ID_LEN = 256  # ids and names: model, tool call ids, message names, metadata.user_id
MAX_FREE_STR = 512  # free strings that are no prompt: `user`, metadata values
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
IdStr = Annotated[str, Field(max_length=MAX_ID_LEN)]
FreeStr = Annotated[str, Field(max_length=MAX_FREE_STR)]
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.:-]{1,128}$")]
TokenId = Annotated[int, Field(ge=0, le=_TOKEN_ID_MAX)]


def check_json(data: Any) -> None:
    """Raise ValueError (a 400) for a body nested deeper than MAX_JSON_DEPTH or holding a
    lone UTF-16 surrogate (JSON's `"\\ud800"` escape decodes to one; no tokenizer or
    encoder takes it), naming where. Iterative: a hostile body cannot exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                raise ValueError(f"{where or 'the body'} holds a lone UTF-16 surrogate (an "
                                 "unpaired \\ud800-\\udfff escape): send valid Unicode")
            continue
        if not isinstance(value, dict | list):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise ValueError(f"{where} is nested deeper than {MAX_JSON_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            path = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and _LONE_SURROGATE.search(key):
                raise ValueError(f"a key in {where or 'the body'} holds a lone UTF-16 surrogate")
            stack.append((item, path, depth + 1))


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Request(_Body):
    """A request body: unknown top-level fields are kept aside and logged, never used.
    Before any field is read, the whole body is checked (`check_json`)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _plain_json(cls, data: Any) -> Any:
        check_json(data)
        return data

    def model_post_init(self, context: Any) -> None:
        if self.model_extra:
            logger.warning("The following fields were present in the request but ignored: %s",
                           sorted(self.model_extra))


class StructuredOutputsRequest(_Body):
    """vLLM's `structured_outputs` extra: exactly one constraint on the whole output."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = Field(None, max_length=1 << 16)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=1024)
    grammar: str | None = Field(None, max_length=1 << 16)
    disable_any_whitespace: bool = False

    def params(self) -> dict[str, Any]:
        """The fields given, as `StructuredOutputsParams` keywords."""
        kw = {"json": self.json_, "json_object": bool(self.json_object), "regex": self.regex,
              "choice": self.choice, "grammar": self.grammar,
              "disable_any_whitespace": self.disable_any_whitespace}
        return {k: v for k, v in kw.items() if v not in (None, False)}


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions, vLLM extras included."""

    model: IdStr | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, le=_SEED_MAX)
    stop: StopStr | list[StopStr] | None = Field(None, max_length=MAX_STOP)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: FreeStr | None = None
    # vLLM's extras, sent by clients in `extra_body`
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    min_p: float | None = Field(None, ge=0, le=1)
    # Far below 1 the penalty scales logits past float range and the sampler fails (a
    # core bug to fix there); no useful penalty lies outside [0.01, 100].
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP)
    cache_salt: str | None = Field(None, max_length=1024)
    # an agent session (extra_body); else `user` names it. KV offload prefetches by it.
    session_id: str | None = Field(None, max_length=1024)
    skip_special_tokens: bool = True
    # token id (as a string, as OpenAI sends it) -> bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )
    structured_outputs: StructuredOutputsRequest | None = None

    def structured_outputs_dict(self) -> dict[str, Any] | None:
        return None if self.structured_outputs is None else self.structured_outputs.params()


class CompletionRequest(_SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


# ---- OpenAI tools -----------------------------------------------------------------------
class FunctionDefinition(_Body):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none means no arguments
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: IdStr


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: IdStr
    arguments: str  # JSON text, as the API sends it


class ToolCallParam(_Body):
    id: IdStr
    type: Literal["function"] = "function"
    function: FunctionCall


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: IdStr | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant
    reasoning_content: str | None = None  # assistant, as vLLM answers it
    tool_call_id: IdStr | None = None  # tool

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template: str | None = Field(None, max_length=1 << 16)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra: keyword arguments for the chat template (`enable_thinking`, ...)
    chat_template_kwargs: dict[str, Any] | None = None
    # given to the chat template as `reasoning_effort` (templates such as gpt-oss's read it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        kw = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kw.setdefault("reasoning_effort", self.reasoning_effort)
        return kw


class TokenizeRequest(_Request):
    model: IdStr | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: IdStr | None = None
    tokens: list[TokenId]


# ---- Anthropic --------------------------------------------------------------------------
class AnthropicText(_Body):
    type: Literal["text"]
    text: str


class AnthropicToolUse(_Body):
    type: Literal["tool_use"]
    id: IdStr
    name: IdStr
    input: dict[str, Any]


class AnthropicToolResult(_Body):
    type: Literal["tool_result"]
    tool_use_id: IdStr
    content: str | list[AnthropicText] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(b.text for b in self.content)


class AnthropicThinking(_Body):
    """A thinking block of an earlier assistant turn, sent back by the client."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class AnthropicRedactedThinking(_Body):
    type: Literal["redacted_thinking"]
    data: str


AnthropicBlock = Annotated[
    AnthropicText | AnthropicToolUse | AnthropicToolResult | AnthropicThinking
    | AnthropicRedactedThinking,
    Field(discriminator="type"),
]


class AnthropicMessage(_Body):
    # "system": a mid-conversation system turn (Claude Code sends them); rendered in place
    # where the chat template allows, else folded into the system prompt
    role: Literal["user", "assistant", "system"]
    content: str | list[AnthropicBlock]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, AnthropicText))


class AnthropicTool(_Body):
    """A client tool (`type` absent or "custom", with an `input_schema`), or one of
    Anthropic's own typed tools (`web_search_20250305`, `bash_20250124`, ...), which this
    server does not run: those are left out of the prompt (logged)."""

    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: Annotated[str, Field(max_length=64)] | None = None
    # tool search: the schema is loaded on demand, so the tool is not in the prompt
    defer_loading: bool | None = None

    @property
    def is_custom(self) -> bool:
        return self.type in (None, "custom")

    @model_validator(mode="after")
    def _schema_for_custom(self) -> AnthropicTool:
        if self.is_custom and self.input_schema is None:
            raise ValueError(f"tool {self.name!r} needs an input_schema")
        return self


class AnthropicToolChoiceAuto(_Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class AnthropicToolChoiceAny(_Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class AnthropicToolChoiceTool(_Body):
    type: Literal["tool"]
    name: IdStr
    disable_parallel_tool_use: bool | None = None


class AnthropicToolChoiceNone(_Body):
    type: Literal["none"]


AnthropicToolChoice = Annotated[
    AnthropicToolChoiceAuto | AnthropicToolChoiceAny | AnthropicToolChoiceTool
    | AnthropicToolChoiceNone,
    Field(discriminator="type"),
]


class AnthropicMetadata(_Body):
    user_id: IdStr | None = None  # Anthropic's limit too


class AnthropicJsonFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(_Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: AnthropicJsonFormat | None = None


class AnthropicThinkingEnabled(_Body):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)
    display: Literal["summarized", "omitted"] | None = None


class AnthropicThinkingAdaptive(_Body):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class AnthropicThinkingDisabled(_Body):
    type: Literal["disabled"]


AnthropicThinkingConfig = Annotated[
    AnthropicThinkingEnabled | AnthropicThinkingAdaptive | AnthropicThinkingDisabled,
    Field(discriminator="type"),
]


class AnthropicCount(_Body):
    """`{"type": "input_tokens" | "tool_uses" | "thinking_turns", "value": N}`."""

    type: Literal["input_tokens", "tool_uses", "thinking_turns"]
    value: int = Field(ge=0, le=1 << 30)


class AnthropicCacheControl(_Body):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class AnthropicClearThinking(_Body):
    """Drop the thinking of earlier assistant turns from the prompt, keeping the last
    `keep` turns' (`{"type": "thinking_turns", "value": N}`, default 1) or "all"."""

    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | AnthropicCount | None = None


class AnthropicClearToolUses(_Body):
    """Once the prompt passes `trigger` input tokens (default 100,000), replace the results
    of all but the last `keep` tool uses (default 3) with a placeholder; `exclude_tools`
    keep theirs, `clear_tool_inputs` clears the calls' inputs too."""

    type: Literal["clear_tool_uses_20250919"]
    trigger: AnthropicCount | None = None
    keep: AnthropicCount | None = None
    clear_at_least: AnthropicCount | None = None
    exclude_tools: list[Annotated[str, Field(max_length=128)]] | None = Field(None, max_length=MAX_TOOLS)
    clear_tool_inputs: bool = False


AnthropicContextEdit = Annotated[
    AnthropicClearThinking | AnthropicClearToolUses, Field(discriminator="type")
]


class AnthropicContextManagement(_Body):
    edits: list[AnthropicContextEdit] = Field(default_factory=list, max_length=8)


class _AnthropicPrompt(_Request):
    model: IdStr
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicText] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinkingConfig | None = None
    output_config: AnthropicOutputConfig | None = None
    # the prefix cache is automatic: every prompt's blocks are cached, marked or not
    cache_control: AnthropicCacheControl | None = None
    context_management: AnthropicContextManagement | None = None

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "".join(b.text for b in self.system) or None


class MessagesRequest(_AnthropicPrompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[StopStr] | None = Field(None, max_length=MAX_STOP)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    metadata: AnthropicMetadata | None = None
    stream: bool | None = False
    service_tier: Literal["auto", "standard_only"] | None = None


class CountTokensRequest(_AnthropicPrompt):
    pass
