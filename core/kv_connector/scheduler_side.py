"""The connector's scheduler side: external hits, what to load, what to save, finishing.

Pure Python (no device import). The scheduler calls, in order:

1. `num_external_tokens(request, num_device_tokens)` when admitting a request, after its
   device prefix-cache hit: how many further tokens the tiers can supply. Loads are
   always asynchronous: the scheduler allocates blocks for them, calls
   `start_load(request, block_ids, num_device_tokens, num_external_tokens)`, and parks
   the request until the load reports.
2. `build_step_meta(scheduled)` once per step: the loads to start and the blocks the
   step fills, to save after its forward pass. A block whose object is being saved or
   is already in the fastest tier is not saved again.
3. `process_report(report)` with each worker report: returns the requests whose loads
   ended and how many of their external tokens arrived (a failed or corrupt block cuts
   the load there; the scheduler recomputes only from that point).
4. `request_finished(request)` when a request stops: True when its blocks must stay
   allocated until a report releases them (a load is still writing into them).

Sessions. A request may name its session (OpenAI `user` / `session_id`, Anthropic
`metadata.user_id`). A turn that ended in a tool call (`session_returns`) says the session
will be back: when its next turn arrives (`request_arrived`), the blocks of its prompt
that only a slower tier holds are prefetched into the fastest one, in the background,
while the turn waits for admission. Writing a session's KV down early needs no hint:
saves are write-through as blocks fill, so an idle session's KV is already in every tier
before the device evicts it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.kv_connector.directory import TierDirectory
from tokenmill.kv_connector.messages import (
    BlockTransfer,
    ConnectorStepMeta,
    LoadJob,
    WorkerReport,
)
from tokenmill.kv_connector.objects import ObjectKey, object_key
from tokenmill.kv_connector.stack import TierStack
from tokenmill.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Load:
    job: LoadJob
    num_device_tokens: int
    tiers: list[str | None]  # where the lookup found each block
    started: bool = False


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    request_id: str
    num_computed_tokens: int  # device hit + the external tokens that arrived
    num_failed_tokens: int  # external tokens promised but not loaded (to recompute)


class KVConnectorScheduler:
    """`stack`: the worker's own TierStack when it runs in this process ("uni"), else the
    TierDirectory mirroring it from the worker's reports ("mp")."""

    def __init__(
        self, stack: TierStack | TierDirectory, fingerprint: bytes, block_size: int
    ) -> None:
        self.stack = stack
        self.fingerprint = fingerprint
        self.block_size = block_size
        self._loads: dict[str, _Load] = {}
        self._saving: set[ObjectKey] = set()
        self._pending_lookup: dict[str, list[str | None]] = {}
        self._returning: OrderedDict[str, None] = OrderedDict()  # sessions hinted to return
        self._prefetch: list[ObjectKey] = []
        self.num_prefetched = 0  # objects prefetches copied up (reported by the worker)

    def key(self, block_hash: bytes) -> ObjectKey:
        return object_key(self.fingerprint, block_hash)

    def num_external_tokens(self, request: Request, num_device_tokens: int) -> int:
        """Tokens after the first `num_device_tokens` (a whole number of blocks) that the
        tiers hold, in whole blocks, leaving at least one token to compute."""
        if request.sampling_params.prompt_logprobs is not None:
            return 0  # every prompt position must be computed to score it
        bs = self.block_size
        start = num_device_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if end <= start:
            return 0
        keys = [self.key(h) for h in request.block_hashes[start:end]]
        where = self.stack.locate(keys)
        n = next((i for i, w in enumerate(where) if w is None), len(where))
        self._pending_lookup[request.request_id] = where[:n]
        return n * bs

    def start_load(
        self, request: Request, block_ids: list[int], num_device_tokens: int, num_tokens: int
    ) -> None:
        """Queue the load of `num_tokens` external tokens into the request's blocks that
        follow its `num_device_tokens` device-hit tokens."""
        bs = self.block_size
        first, n = num_device_tokens // bs, num_tokens // bs
        hashes = request.block_hashes[first : first + n]
        blocks = [BlockTransfer(b, self.key(h)) for b, h in zip(block_ids[first:], hashes)]
        tiers = self._pending_lookup.pop(request.request_id, [None] * n)
        self._loads[request.request_id] = _Load(
            LoadJob(request.request_id, blocks), num_device_tokens, tiers[:n]
        )

    _MAX_SESSIONS = 65536  # hints kept, oldest dropped first

    def session_returns(self, session_id: str) -> None:
        """The session's last turn ended in a tool call: prefetch its next turn."""
        self._returning[session_id] = None
        self._returning.move_to_end(session_id)
        while len(self._returning) > self._MAX_SESSIONS:
            self._returning.popitem(last=False)

    def request_arrived(self, request: Request) -> None:
        """A new request; with `request.block_hashes` filled. Queues the prefetch of its
        prompt's blocks if its session was hinted to return."""
        sid = request.session_id
        if sid is None or sid not in self._returning:
            return
        del self._returning[sid]
        self._prefetch.extend(self.key(h) for h in request.block_hashes)

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loads

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def build_step_meta(self, scheduled: list[tuple[Request, list[int], int, int]]) -> ConnectorStepMeta:
        """`scheduled`: (request, block ids, first token computed, tokens computed) for each
        request in the step."""
        meta = ConnectorStepMeta(prefetch=self._prefetch)
        self._prefetch = []
        for load in self._loads.values():
            if not load.started:
                load.started = True
                meta.loads.append(load.job)
        bs = self.block_size
        for request, block_ids, start, num_new in scheduled:
            end = min((start + num_new) // bs, len(request.block_hashes), len(block_ids))
            for i in range(start // bs, end):
                key = self.key(request.block_hashes[i])
                if key in self._saving or self.stack.fastest_holds(key):
                    continue
                self._saving.add(key)
                meta.saves.append(BlockTransfer(block_ids[i], key))
        self._pending_lookup.clear()
        return meta

    def process_report(self, report: WorkerReport) -> list[LoadOutcome]:
        if isinstance(self.stack, TierDirectory):
            self.stack.apply(report)  # first: the counts below land on its fresh counters
        self.num_prefetched += report.num_prefetched
        for key in report.saved_keys:
            self._saving.discard(key)
        for key in report.failed_save_keys:
            self._saving.discard(key)
        outcomes = []
        for result in report.loads:
            load = self._loads.pop(result.request_id, None)
            if load is None:
                continue
            bs = self.block_size
            failed = result.num_requested - result.num_loaded
            for tier_name in result.tiers:
                self.stack.count(tier_name, tokens_loaded=bs)
            for promised in load.tiers[result.num_loaded :]:
                if promised is not None:
                    self.stack.count(promised, tokens_recomputed=bs)
            if failed:
                logger.warning(
                    "KV load for %s stopped at block %d of %d; recomputing from there",
                    result.request_id, result.num_loaded, result.num_requested,
                )
            outcomes.append(
                LoadOutcome(
                    result.request_id,
                    load.num_device_tokens + result.num_loaded * bs,
                    failed * bs,
                )
            )
        return outcomes

    def request_finished(self, request: Request) -> bool:
        """True: keep the request's blocks until a report ends its load (the worker may
        still be writing into them); False: free them now. Saves never hold blocks: the
        worker copies a block out during the step that fills it."""
        load = self._loads.get(request.request_id)
        if load is not None and not load.started:
            del self._loads[request.request_id]  # never sent: nothing writes into the blocks
            return False
        return load is not None
