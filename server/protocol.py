"""Request bodies of the OpenAI and Anthropic APIs, as pydantic models with hard limits.

Unknown top-level fields of a request are logged and ignored, as vLLM does (SDKs send
fields we do not use; nested unknown fields are ignored); NaN and infinities are
rejected everywhere; every number that reaches the engine is bounded here so that no
schema-valid request can make the server fail.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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

StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.:-]{1,128}$")]
TokenId = Annotated[int, Field(ge=0, le=_TOKEN_ID_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Request(_Body):
    """A request body: unknown top-level fields are kept aside and logged, never used."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

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

    model: str | None = None
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
    user: str | None = None
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
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as the API sends it


class ToolCallParam(_Body):
    id: str
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
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant
    reasoning_content: str | None = None  # assistant, as vLLM answers it
    tool_call_id: str | None = None  # tool

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
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# ---- Anthropic --------------------------------------------------------------------------
class AnthropicText(_Body):
    type: Literal["text"]
    text: str


class AnthropicToolUse(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicToolResult(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
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
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, AnthropicText))


class AnthropicTool(_Body):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class AnthropicToolChoiceAuto(_Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class AnthropicToolChoiceAny(_Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class AnthropicToolChoiceTool(_Body):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class AnthropicToolChoiceNone(_Body):
    type: Literal["none"]


AnthropicToolChoice = Annotated[
    AnthropicToolChoiceAuto | AnthropicToolChoiceAny | AnthropicToolChoiceTool
    | AnthropicToolChoiceNone,
    Field(discriminator="type"),
]


class AnthropicMetadata(_Body):
    user_id: str | None = None


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


class AnthropicCacheControl(_Body):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _AnthropicPrompt(_Request):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicText] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinkingConfig | None = None
    output_config: AnthropicOutputConfig | None = None
    # the prefix cache is automatic: every prompt's blocks are cached, marked or not
    cache_control: AnthropicCacheControl | None = None

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
