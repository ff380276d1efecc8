"""The Responses API's store: answered responses by id, for `GET /v1/responses/{id}` and
`previous_response_id`. Bounded: the least recently used response is evicted first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    # The conversation up to and including this response's output, as HF chat messages,
    # without its `instructions` (a follow-up brings its own, as with OpenAI).
    conversation: list[dict[str, Any]]


class ResponseStore:
    """An LRU map of response id -> StoredResponse, of at most `max_responses` entries.

    Used from the event loop only (no locking). `get` counts as a use.
    """

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses={max_responses} must be >= 1")
        self.max_responses = max_responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_responses:
            self._entries.popitem(last=False)
            self.num_evicted += 1

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored
