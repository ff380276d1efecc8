"""The server's bound on requests waiting for the engine (`--max-waiting-requests`).

A request the engine cannot start at once waits in its scheduler; unbounded, a burst
queues minutes of work that clients have long given up on. Here a request is admitted
only while the sequences that would then wait stay within `max_waiting`; otherwise it is
a 429 with a Retry-After estimated from how fast requests have been finishing.

What waits: of the sequences in flight, those beyond what can run. While the engine
reports no waiting sequence, `max_num_seqs` can run; once it reports some (its KV cache
is full before `max_num_seqs`), only those running now can. Used from the event loop
only.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from tokenmill.frontend.outputs import SchedulerStats

# A full queue of the embedded SmolLM2-135M on the 2-core CPU this project is built on
# drains in about a minute (docs/server.md, "Limits that answer").
DEFAULT_MAX_WAITING_REQUESTS = 64
_MAX_RETRY_AFTER_S = 60


class QueueFull(Exception):
    """Admitting the request would put more than `max_waiting` sequences in the queue."""

    def __init__(self, waiting: int, max_waiting: int, retry_after_s: int) -> None:
        super().__init__(
            f"the server is at capacity: {waiting} sequences wait for the engine, the limit "
            f"is {max_waiting} (--max-waiting-requests); retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class Admission:
    """Counts the sequences in flight; `admit` refuses those that would wait past the bound."""

    def __init__(self, max_waiting: int, max_num_seqs: int,
                 stats: Callable[[], SchedulerStats]) -> None:
        if max_waiting < 0 or max_num_seqs < 1:
            raise ValueError(f"Admission(max_waiting={max_waiting}, max_num_seqs="
                             f"{max_num_seqs}): max_waiting must be >= 0, max_num_seqs >= 1")
        self.max_waiting = max_waiting
        self.max_num_seqs = max_num_seqs
        self.stats = stats
        self.in_flight = 0  # sequences admitted and not yet released
        self._finished: deque[float] = deque(maxlen=64)  # when the last releases happened

    def waiting_after(self, num_seqs: int) -> int:
        """How many sequences would wait once `num_seqs` more are in flight."""
        stats = self.stats()
        slots = stats.num_running if stats.num_waiting > 0 else self.max_num_seqs
        return max(self.in_flight + num_seqs - slots, 0)

    @property
    def capacity(self) -> int:
        """The most sequences one request may bring: all that can run and wait at once."""
        return self.max_num_seqs + self.max_waiting

    def admit(self, num_seqs: int) -> None:
        """Count `num_seqs` sequences in, or raise QueueFull (nothing counted). A request
        of more than `capacity` sequences is a ValueError: no wait would help it."""
        if num_seqs > self.capacity:
            raise ValueError(
                f"this request asks for {num_seqs} sequences (prompts x n); the server runs "
                f"{self.max_num_seqs} and queues {self.max_waiting} at most: split it")
        self.check(num_seqs)
        self.in_flight += num_seqs

    def check(self, num_seqs: int) -> None:
        """Raise QueueFull if `num_seqs` more sequences would wait past the bound."""
        if self.waiting_after(num_seqs) > self.max_waiting:
            queued = self.waiting_after(0)
            raise QueueFull(queued, self.max_waiting, self.retry_after_s(max(queued, 1)))

    def release(self, num_seqs: int) -> None:
        """`num_seqs` admitted sequences finished (or failed, or were abandoned)."""
        self.in_flight -= num_seqs
        now = time.monotonic()
        self._finished.extend([now] * min(num_seqs, self._finished.maxlen))

    def retry_after_s(self, waiting: int) -> int:
        """Seconds until about `waiting` sequences have gone, at the recent finishing rate
        (1 to 60; 1 before anything has finished)."""
        if len(self._finished) < 2:
            return 1
        span = max(time.monotonic() - self._finished[0], 1e-3)
        rate = len(self._finished) / span
        return min(max(math.ceil(waiting / rate), 1), _MAX_RETRY_AFTER_S)


class Ticket:
    """One request's admitted sequences, released once, however the request ends."""

    __slots__ = ("admission", "num_seqs")

    def __init__(self, admission: Admission, num_seqs: int) -> None:
        self.admission, self.num_seqs = admission, num_seqs

    def release(self, num_seqs: int | None = None) -> None:
        """Release `num_seqs` of the ticket's sequences (all that are left by default)."""
        n = self.num_seqs if num_seqs is None else min(num_seqs, self.num_seqs)
        if n > 0:
            self.num_seqs -= n
            self.admission.release(n)
