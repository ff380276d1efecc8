"""Which data-parallel replica runs a request: prefix-cache affinity, else least loaded.

Each replica is a whole engine core with its own prefix cache, so a request is cheapest
where its prefix was computed before. The policy, per request:

1. Key the request by the chain hashes of its first `affinity_blocks` full prompt blocks
   (tokenmill.kv.hashing, the cache salt mixed into the first, as the KV cache keys
   them: a different salt never shares a replica's blocks, so it never steers there).
2. Affinity: the replica that last took a request with the deepest of those keys gets
   it (an agent's next turn repeats its history, so its first blocks match the last
   turn's), if that key is at least `min_match` of the way down the request's keys (a
   chat template's or a shared system prompt's first block alone would pull every
   session onto one replica) and that replica does not already run `max_imbalance`
   more requests than the least loaded one (then the load wins).
3. Otherwise the least loaded replica (fewest unfinished requests; the lowest index on
   a tie).

Every key of the request then points at the chosen replica (the most recent wins; the
table keeps the `capacity` most recently used keys). Load counts a request from `route`
to `finished`. Pure Python; thread-safe (the frontend routes from its request threads
and learns of finishes on output threads).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.kv.hashing import BlockHash, hash_blocks


@dataclass(slots=True)
class RouterStats:
    num_routed: int = 0
    num_affinity: int = 0  # sent where their prefix (most of its first blocks) was before
    num_overridden: int = 0  # had a prefix home but went to a less loaded replica


class PrefixAffinityRouter:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        affinity_blocks: int = 4,
        max_imbalance: int = 8,
        min_match: float = 0.5,
        capacity: int = 65536,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.affinity_blocks = affinity_blocks
        self.max_imbalance = max_imbalance
        self.min_match = min_match
        self.capacity = capacity
        self.loads = [0] * num_replicas  # unfinished requests per replica
        self.stats = RouterStats()
        self._homes: OrderedDict[BlockHash, int] = OrderedDict()  # prefix key -> replica
        self._owners: dict[str, int] = {}  # request id -> replica, until finished
        self._lock = threading.Lock()

    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        """The request's affinity keys: chain hashes of its first full blocks."""
        head = list(token_ids[: self.affinity_blocks * self.block_size])
        extra = (("salt", cache_salt),) if cache_salt else ()
        return hash_blocks(head, self.block_size, extra)

    def route(self, request_id: str, token_ids: Sequence[int],
              cache_salt: str | None = None) -> int:
        """The replica for a new request (counted in its load until `finished`). Raises
        ValueError for an id that is already routed and not finished."""
        keys = self.keys(token_ids, cache_salt)
        with self._lock:
            if request_id in self._owners:
                raise ValueError(f"request id {request_id!r} is already running on replica "
                                 f"{self._owners[request_id]}")
            least = min(range(self.num_replicas), key=lambda i: (self.loads[i], i))
            chosen = least
            depth = next((d for d in range(len(keys), 0, -1) if keys[d - 1] in self._homes), 0)
            home = self._homes[keys[depth - 1]] if depth else None
            if home is not None and depth < self.min_match * len(keys):
                home = None  # only the first blocks in common: not this request's history
            if home is not None:
                if self.loads[home] - self.loads[least] < self.max_imbalance:
                    chosen = home
                    self.stats.num_affinity += 1
                else:
                    self.stats.num_overridden += 1
            for key in keys:
                self._homes[key] = chosen
                self._homes.move_to_end(key)
            while len(self._homes) > self.capacity:
                self._homes.popitem(last=False)
            self._owners[request_id] = chosen
            self.loads[chosen] += 1
            self.stats.num_routed += 1
            return chosen

    def owner(self, request_id: str) -> int | None:
        """The replica running `request_id`; None once finished (or never routed)."""
        with self._lock:
            return self._owners.get(request_id)

    def finished(self, request_id: str) -> None:
        """`request_id` ended (any reason); unknown ids are ignored."""
        with self._lock:
            replica = self._owners.pop(request_id, None)
            if replica is not None:
                self.loads[replica] -= 1
