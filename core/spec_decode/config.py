"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's shape, validated."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SpecMethod = Literal["suffix", "ngram", "mtp", "eagle3"]


class SpeculativeConfig(BaseModel):
    """What to speculate with. Field names are vLLM's (`--speculative-config` JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: SpecMethod
    num_speculative_tokens: int = Field(
        ..., ge=1, le=64, description="the most draft tokens proposed per request per step"
    )
    # ngram (prompt lookup): match the last n tokens, n in [min, max], earlier in the sequence
    prompt_lookup_max: int = Field(5, ge=1)
    prompt_lookup_min: int = Field(2, ge=1)
    # suffix decoding (arctic-inference's parameters)
    suffix_decoding_max_tree_depth: int = Field(
        24, ge=1, description="the longest context suffix matched against the trees"
    )
    suffix_decoding_max_cached_requests: int = Field(
        1000, ge=0, description="finished outputs kept in the global tree (0: none)"
    )
    suffix_decoding_max_spec_factor: float = Field(
        1.0, gt=0, description="draft length <= match length x this factor (+ offset)"
    )
    suffix_decoding_max_spec_offset: float = Field(0.0, ge=0)
    suffix_decoding_min_token_prob: float = Field(
        0.1, ge=0, le=1, description="stop the draft where its estimated probability drops below"
    )
    # eagle3: the draft head's checkpoint (an HF directory beside the target)
    model: str | None = None
    # adaptivity: stop speculating when it loses (docs/speculative.md)
    adaptive: bool = True

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} is above prompt_lookup_max="
                f"{self.prompt_lookup_max}"
            )
        if self.method == "eagle3" and not self.model:
            raise ValueError(
                "method 'eagle3' needs the draft head's checkpoint: set \"model\" to its "
                "directory"
            )
        if self.method in ("ngram", "suffix", "mtp") and self.model:
            raise ValueError(f"method {self.method!r} takes no draft \"model\" ({self.model!r})")
        return self

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From the CLI's JSON string, a dict (LLM's keyword) or a config; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"--speculative-config {value!r} is not JSON: {e}; e.g. "
                    '\'{"method": "suffix", "num_speculative_tokens": 8}\''
                ) from e
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        return cls.model_validate(value)
