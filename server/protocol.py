"""Request bodies of the OpenAI and Anthropic APIs, as pydantic models with hard limits.

Unknown fields are ignored (SDKs send fields we do not use); NaN and infinities are
rejected everywhere; every number that reaches the engine is bounded here so that no
schema-valid request can make the server fail.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # completions per request
MAX_LOGPROBS = 20  # top logprobs per token
MAX_STOP = 16  # stop strings per request
MAX_STOP_LEN = 256  # characters per stop string
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_BODY_BYTES = 4 << 20
MAX_HEADER_BYTES = 16 << 10
_SEED_MAX = (1 << 63) - 1 - MAX_N  # seed + i (i < n) must stay a valid torch seed
_TOKEN_ID_MAX = (1 << 31) - 1

StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
TokenId = Annotated[int, Field(ge=0, le=_TOKEN_ID_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
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
    skip_special_tokens: bool = True


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


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

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


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


# ---- Anthropic --------------------------------------------------------------------------
class AnthropicText(_Body):
    type: Literal["text"]
    text: str


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


class AnthropicMetadata(_Body):
    user_id: str | None = None


class _AnthropicPrompt(_Body):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicText] | None = None

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "".join(b.text for b in self.system) or None

    def chat_messages(self) -> list[dict[str, Any]]:
        conv = []
        system = self.system_text()
        if system:
            conv.append({"role": "system", "content": system})
        conv.extend({"role": m.role, "content": m.text()} for m in self.messages)
        return conv


class MessagesRequest(_AnthropicPrompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[StopStr] | None = Field(None, max_length=MAX_STOP)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    metadata: AnthropicMetadata | None = None
    stream: bool | None = False


class CountTokensRequest(_AnthropicPrompt):
    pass
