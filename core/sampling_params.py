"""How to sample one request: vLLM's `SamplingParams`, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenmill.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """Sampling controls for one request.

    Construction validates every field and raises `ValueError` naming the bad value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per sampled token (+ the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> value added to its logit before sampling, in [-100, 100] as OpenAI's
    # logit_bias (-100 in effect bans the token, +100 all but forces it)
    logit_bias: dict[int, float] | None = None
    # constrained decoding: the output must match this schema / regex / choice / grammar
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from the tokenizer, not by users.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        for name in (
            "temperature", "top_p", "min_p", "repetition_penalty",
            "presence_penalty", "frequency_penalty",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise bad(name, "must be a number")
            if not math.isfinite(value):
                raise bad(name, "must be finite")
        for name in ("n", "top_k", "min_tokens"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise bad(name, "must be an integer")
        if self.n < 1:
            raise bad("n", "must be at least 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be a positive integer or None")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, "must be None or a non-negative integer")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "must be a StructuredOutputsParams or None")
        self._validate_logit_bias()
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer or None")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop contains {s!r}: stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"SamplingParams.stop_token_ids contains {t!r}: must be token ids >= 0")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"SamplingParams.logit_bias={self.logit_bias!r:.80}: must be a dict "
                             "of token id -> bias, or None")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"SamplingParams.logit_bias has key {t!r}: must be token ids >= 0")
            if (not isinstance(b, int | float) or isinstance(b, bool) or not math.isfinite(b)
                    or not -100 <= b <= 100):
                raise ValueError(f"SamplingParams.logit_bias[{t}]={b!r}: must be a number in "
                                 "[-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
