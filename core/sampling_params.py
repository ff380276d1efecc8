"""How to sample one request: vLLM's `SamplingParams`, validated at construction."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenmill.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5

# The fields a model's generation config may supply, with the values that apply when
# neither the request nor the model sets them (vLLM's: sampling with nothing filtered).
NEUTRAL_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


@dataclass(slots=True)
class SamplingParams:
    """Sampling controls for one request.

    Construction validates every field and raises `ValueError` naming the bad value.
    The fields of `NEUTRAL_DEFAULTS` may be left None, meaning unset: the engine fills
    them from the model's generation config (vLLM's `--generation-config auto`), else
    with the neutral values, when it accepts the request (`with_defaults`). A value the
    caller gives always wins.
    """

    n: int = 1
    temperature: float | None = None  # 0: greedy; None: the model's default, else 1.0
    top_p: float | None = None  # None: the model's default, else 1.0
    top_k: int | None = None  # 0 or -1: no top-k; None: the model's default, else 0
    min_p: float | None = None  # None: the model's default, else 0.0
    repetition_penalty: float | None = None  # None: the model's default, else 1.0
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

    @property
    def unset_fields(self) -> tuple[str, ...]:
        """The fields of NEUTRAL_DEFAULTS this request leaves to the model's defaults."""
        return tuple(name for name in NEUTRAL_DEFAULTS if getattr(self, name) is None)

    def with_defaults(self, defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
        """A copy with every unset field filled: from `defaults` (a model's generation
        config) where it has the field, else the neutral value. Set fields are kept."""
        unset = self.unset_fields
        if not unset:
            return self
        defaults = defaults or {}
        return dataclasses.replace(
            self, **{name: defaults.get(name, NEUTRAL_DEFAULTS[name]) for name in unset}
        )

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        unset = self.unset_fields
        for name in (
            "temperature", "top_p", "min_p", "repetition_penalty",
            "presence_penalty", "frequency_penalty",
        ):
            value = getattr(self, name)
            if name in unset:
                continue
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise bad(name, "must be a number")
            if not math.isfinite(value):
                raise bad(name, "must be finite")
        for name in ("n", "top_k", "min_tokens"):
            if name in unset:
                continue
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise bad(name, "must be an integer")
        if self.n < 1:
            raise bad("n", "must be at least 1")
        if self.temperature is not None and self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k is not None and self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
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
        """Whether the temperature is 0. Unset counts as not greedy: call it on params
        with their defaults filled (the engine's, or `with_defaults()`)."""
        return self.temperature is not None and self.temperature < _GREEDY_EPS

    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
