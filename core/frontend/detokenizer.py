"""Token ids to text, one step at a time, and stop-string search over the new text."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# How many prompt tokens the first decode window reaches back (vLLM uses the same): enough
# for decoders that drop a leading space on the first token (Metaspace) to see a prefix.
_PROMPT_CONTEXT = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes one request's output tokens as they arrive, vLLM's prefix/read-offset way.

    Each step decodes only a short window of tokens: the text of tokens[prefix:read] is
    already emitted, tokens[prefix:] decoded together yields it plus the new text. Text is
    held back while it ends in U+FFFD (an incomplete UTF-8 sequence split across byte-level
    tokens), so `append` never returns half a character. Held-back text is emitted by the
    later token that completes it (bytes left incomplete when generation ends are never
    emitted, as in vLLM); `output_text` is always the concatenation of what `append`
    returned.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_ids = frozenset(tokenizer.all_special_ids if skip_special_tokens else ())
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        self._tokens: list[str] = self._to_tokens(context)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._text_parts: list[str] = []
        self._num_chars = 0

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        text = "".join(self._text_parts)
        self._text_parts = [text]
        return text

    @property
    def num_chars(self) -> int:
        """len(output_text), without joining."""
        return self._num_chars

    def append(self, new_token_ids: list[int]) -> str:
        """Takes the step's new tokens (one, or several with speculative decoding) and
        returns the text they finalised, possibly "" (a special token being skipped, or a
        character still incomplete)."""
        pieces = []
        for token in self._to_tokens(new_token_ids):
            self._tokens.append(token)
            prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
            window_text = self._decode(self._tokens[self._prefix_offset :])
            if len(window_text) > len(prefix_text) and not window_text.endswith(
                _REPLACEMENT_CHAR
            ):
                pieces.append(window_text[len(prefix_text) :])
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._tokens)
        text = "".join(pieces)
        if text:
            self._text_parts.append(text)
            self._num_chars += len(text)
        return text

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        convert = self._tokenizer.convert_ids_to_tokens
        return [convert(int(t)) for t in token_ids if t not in self._skip_ids]

    def _decode(self, tokens: list[str]) -> str:
        return self._tokenizer.convert_tokens_to_string(tokens) if tokens else ""


def find_stop(
    output_text: str, num_new_chars: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """The stop string that completes first in `output_text`, and where to cut the text.

    Only matches that end inside the last `num_new_chars` characters are considered (older
    ones were checked on earlier steps), so the search covers just the last
    num_new_chars + len(stop_str) - 1 characters, which is what catches a stop string split
    across tokens. Among several matches the one that ends first wins (where generation
    would have stopped had the text arrived a character at a time), then the one that
    starts first. Returns (stop_str, truncate_to_len): keep output_text[:truncate_to_len],
    which ends just before the stop string, or just after it when
    `include_stop_str_in_output`. None when no stop string matches.
    """
    if num_new_chars < 0:
        raise ValueError(f"num_new_chars={num_new_chars} must be >= 0")
    best: tuple[int, int, str] | None = None  # (end, start, stop_str)
    for stop_str in stop:
        first_start = len(output_text) - num_new_chars - len(stop_str) + 1
        start = output_text.find(stop_str, max(0, first_start))
        if start == -1:
            continue
        match = (start + len(stop_str), start, stop_str)
        if best is None or match[:2] < best[:2]:
            best = match
    if best is None:
        return None
    end, start, stop_str = best
    return stop_str, end if include_stop_str_in_output else start
