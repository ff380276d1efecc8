"""The Responses API's store: answered responses by id, for `GET /v1/responses/{id}` and
`previous_response_id`. Bounded by entries and by bytes: the least recently used response
is evicted first."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

logger = logging.getLogger("tokenmill.server")

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    # The conversation up to and including this response's output, as HF chat messages,
    # without its `instructions` (a follow-up brings its own, as with OpenAI).
    conversation: list[dict[str, Any]]
    num_bytes: int = field(default=0, compare=False)  # set by the store: its JSON size


class ResponseStore:
    """An LRU map of response id -> StoredResponse, of at most `max_responses` entries
    holding at most `max_bytes` (their JSON size: every previous turn of a session is in
    each of its responses, so one long session alone can fill memory).

    Used from the event loop only (no locking). `get` counts as a use.
    """

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(f"ResponseStore(max_responses={max_responses}, "
                             f"max_bytes={max_bytes}): both must be >= 1")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0
        self.num_evicted = 0
        self._encoder = msgspec.json.Encoder()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Store `stored`, evicting the least recently used as needed; False (and nothing
        stored) when it alone is over `max_bytes`."""
        size = len(self._encoder.encode([stored.response, stored.conversation]))
        if size > self.max_bytes:
            logger.warning("response %s is %d bytes, over the store's %d: not stored",
                           response_id, size, self.max_bytes)
            return False
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.num_bytes -= old.num_bytes
        self._entries[response_id] = StoredResponse(stored.response, stored.conversation, size)
        self.num_bytes += size
        while len(self._entries) > self.max_responses or self.num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
            self.num_evicted += 1
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored
