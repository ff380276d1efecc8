"""The handover's scheduler side, pure Python: leases on the prefill side, admission and
pulls on the decode side.

Prefill side. A request marked `handover_out` computes its prompt and samples one token,
then finishes without giving its KV back: its blocks (every group's table, a recurrent
group's state slot holding the state after exactly the prompt) stay allocated under a
lease (`hold`), described by a `HandoverOffer`, until the decode side releases it
(`release`) or it times out (`expire`).

Decode side. A request with `handover_in` (the offer, its peer) is admitted by `admit`:
its first token (the prefill's) is already appended, so it holds prompt + 1 tokens; its
own prefix cache serves what it can (the leading cached blocks of each attention group,
up to the last full prompt block; a window's from the block its next query reads), fresh
blocks take the rest up to the prompt's end, and a recurrent group gets its state slot.
Only the blocks it lacks and the slot are pulled, one `PullJob`, while other requests
keep decoding. When the pull ends the request continues from the whole prompt with no
token recomputed (`pulled`), or, if it failed, gives its blocks back and is admitted
again as an ordinary request that computes its prompt here (`failed`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tokenmill.engine.request import Request
from tokenmill.kv.block_pool import NULL_BLOCK, KVBlock
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv.recurrent import RecurrentStateAllocator
from tokenmill.kv_connector.handover.messages import HandoverOffer, HandoverStats, prompt_digest
from tokenmill.platforms.kv_handover import HandoverReport, HandoverStepMeta, PullJob, PullResult
from tokenmill.platforms.step import Logprobs
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Lease:
    request: Request
    offer: HandoverOffer
    expires: float


@dataclass(slots=True)
class _Pending:
    request: Request
    job: PullJob
    skipped: int  # blocks the local prefix cache supplied
    started: bool = False


@dataclass(slots=True)
class HandoverCounters:
    offered: int = 0
    received: int = 0
    failed: int = 0
    bytes_moved: int = 0
    transport_bytes: int = 0
    blocks_pulled: int = 0
    blocks_skipped: int = 0
    lease_timeouts: int = 0
    transfer_seconds: float = 0.0
    peers_sent: set[str] = field(default_factory=set)


class HandoverScheduler:
    """`engine_id`: this engine's id (offers name it); `lease_s`: how long a prefill
    engine holds a computed prompt for its decode engine; `pull_deadline_s`: how long a
    decode engine waits for a pull before computing the prompt itself."""

    def __init__(self, engine_id: str, lease_s: float = 30.0,
                 pull_deadline_s: float = 20.0) -> None:
        self.engine_id = engine_id
        self.lease_s = lease_s
        self.pull_deadline_s = pull_deadline_s
        self.counters = HandoverCounters()
        self._leases: dict[str, _Lease] = {}
        self._pending: dict[str, _Pending] = {}

    # ---- prefill side ------------------------------------------------------------------
    def hold(self, request: Request, kv: KVCacheManager, logprobs: Logprobs | None,
             now: float | None = None) -> HandoverOffer:
        """Keep `request`'s blocks (it just sampled its first token) under a lease."""
        offer = HandoverOffer(
            lease_id=request.request_id, engine_id=self.engine_id,
            num_tokens=request.num_prompt_tokens,
            prompt_digest=prompt_digest(request.prompt_token_ids),
            block_ids=kv.group_block_ids(request),
            first_token=request.output_token_ids[0], first_logprobs=logprobs,
            num_cached_tokens=max(0, request.num_cached_tokens),
        )
        now = time.monotonic() if now is None else now
        self._leases[request.request_id] = _Lease(request, offer, now + self.lease_s)
        self.counters.offered += 1
        return offer

    def hold_prefix(self, lease_id: str, token_ids: list[int], kv: KVCacheManager,
                    cache_salt: str | None = None, now: float | None = None,
                    ) -> tuple[HandoverOffer, Request] | None:
        """Lease the longest prefix of `token_ids` this engine's prefix cache can serve
        (every group: full blocks, a window's last blocks, a recurrent group's checkpoint
        at the boundary; `KVCacheManager.find_cached_prefix`), for another engine to pull
        (a prefix offer). None when nothing is cached."""
        if lease_id in self._leases:
            raise ValueError(f"lease id {lease_id!r} is already in use")
        request = Request(lease_id, list(token_ids), SamplingParams(max_tokens=1),
                          cache_salt=cache_salt)
        hits, num_tokens = kv.find_cached_prefix(request)
        if not num_tokens:
            return None
        for alloc, table in zip(kv.allocators, hits.tables, strict=True):
            alloc.take_hits(request, table)  # held (referenced) until the lease ends
        offer = HandoverOffer(
            lease_id=lease_id, engine_id=self.engine_id, num_tokens=num_tokens,
            prompt_digest=prompt_digest(request.prompt_token_ids[:num_tokens]),
            block_ids=[[b.block_id for b in table] for table in hits.tables],
            first_token=-1, prefix=True,
        )
        now = time.monotonic() if now is None else now
        self._leases[lease_id] = _Lease(request, offer, now + self.lease_s)
        self.counters.offered += 1
        return offer, request

    def release(self, lease_id: str) -> Request | None:
        """The decode side is done with `lease_id`: its request, whose blocks the caller
        frees (None: unknown, already released or timed out)."""
        lease = self._leases.pop(lease_id, None)
        return None if lease is None else lease.request

    def expire(self, now: float | None = None) -> list[Request]:
        """Leases past their time: their requests, whose blocks the caller frees."""
        now = time.monotonic() if now is None else now
        gone = [lid for lid, lease in self._leases.items() if lease.expires <= now]
        for lid in gone:
            logger.warning("handover lease %s timed out after %.0f s: its KV is freed",
                           lid, self.lease_s)
        self.counters.lease_timeouts += len(gone)
        return [self._leases.pop(lid).request for lid in gone]

    def next_expiry(self) -> float | None:
        return min((lease.expires for lease in self._leases.values()), default=None)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    # ---- decode side -------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """Raise ValueError naming the problem if `request`'s handover cannot apply."""
        offer = request.handover_in.offer
        if offer.prefix:
            self._check_prefix(request, offer)
            return
        if offer.num_tokens != request.num_prompt_tokens or offer.prompt_digest != prompt_digest(
                request.prompt_token_ids):
            raise ValueError(
                f"handover {offer.lease_id} from {offer.engine_id} is for a prompt of "
                f"{offer.num_tokens} tokens that differs from this request's "
                f"{request.num_prompt_tokens}: both engines must tokenize the same request")

    @staticmethod
    def _check_prefix(request: Request, offer: HandoverOffer) -> None:
        if not 0 < offer.num_tokens < request.num_prompt_tokens or offer.prompt_digest != (
                prompt_digest(request.prompt_token_ids[:offer.num_tokens])):
            raise ValueError(
                f"prefix offer {offer.lease_id} from {offer.engine_id} covers {offer.num_tokens} "
                f"tokens that are not a proper prefix of this request's "
                f"{request.num_prompt_tokens}-token prompt: offer the request's own prompt")

    def admit(self, request: Request, kv: KVCacheManager) -> bool:
        """Allocate `request`'s KV (its first token appended: it holds prompt + 1 tokens;
        a prefix offer's: the prefix only) and queue the pull of what its prefix cache
        lacks. False: its blocks do not fit
        now (nothing changed; it waits like any prompt that does not fit)."""
        offer = request.handover_in.offer
        tables, need = self._plan(request, kv, offer.num_tokens)
        hits = [b for t in tables for b in t if b is not NULL_BLOCK]
        num_hits_free = sum(1 for b in hits if b.ref_cnt == 0)
        if need + num_hits_free > kv.pool.num_free_blocks:
            return False
        rid = request.request_id
        for alloc, table in zip(kv.allocators, tables, strict=True):
            alloc.take_hits(request, table)
        pairs, groups, skipped = [], [], 0
        num_blocks = -(-offer.num_tokens // kv.block_size)
        for g, alloc in enumerate(kv.allocators):
            remote = offer.block_ids[g]
            if isinstance(alloc, RecurrentStateAllocator):
                slot = alloc.allocate_slot(request)
                pairs += zip(remote, (b.block_id for b in slot), strict=True)
                groups += [g] * len(slot)
                continue
            alloc.allocate(request, offer.num_tokens)
            local = alloc.req_to_blocks[rid]
            for j in range(alloc.first_needed_block(offer.num_tokens), num_blocks):
                if j < len(tables[g]) and tables[g][j] is not NULL_BLOCK:
                    skipped += 1
                else:
                    pairs.append((remote[j], local[j].block_id))
                    groups.append(g)
        request.num_computed_tokens = 0
        job = PullJob(rid, offer.engine_id, pairs, self.pull_deadline_s, groups)
        self._pending[rid] = _Pending(request, job, skipped)
        return True

    @staticmethod
    def _plan(request: Request, kv: KVCacheManager, num_tokens: int) -> tuple[list[list[KVBlock]], int]:
        """Per group the hit table the request starts with (its prefix cache's leading
        cached blocks of the prompt's full blocks; a window's from the first block its
        next query reads, the null block before), and the fresh blocks the rest needs."""
        kv.update_block_hashes(request)
        max_blocks = num_tokens // kv.block_size  # a block holding the prompt's end is pulled
        tables, need = [], 0
        for alloc in kv.allocators:
            if isinstance(alloc, RecurrentStateAllocator):
                tables.append([])
                need += alloc.state_pages
                continue
            first = alloc.first_needed_block(num_tokens)
            table: list[KVBlock] = [NULL_BLOCK] * first
            if kv.enable_prefix_caching and request.sampling_params.prompt_logprobs is None:
                cached = alloc.cached_blocks(request, max_blocks)
                for j in range(first, min(max_blocks, len(cached))):
                    if cached[j] is None:
                        break
                    table.append(cached[j])
            need += max(0, -(-num_tokens // kv.block_size) - len(table))
            tables.append(table)
        return tables, need

    def step_meta(self) -> HandoverStepMeta | None:
        """The pulls to start with this step, and the peers the workers have not met."""
        meta = HandoverStepMeta()
        for pending in self._pending.values():
            if pending.started:
                continue
            pending.started = True
            engine = pending.request.handover_in.peer
            if engine.engine_id not in self.counters.peers_sent:
                self.counters.peers_sent.add(engine.engine_id)
                meta.peers.append(engine)
            meta.pulls.append(pending.job)
        return meta if meta.pulls else None

    def is_pulling(self, request_id: str) -> bool:
        pending = self._pending.get(request_id)
        return pending is not None and pending.started

    def drop(self, request_id: str) -> bool:
        """A request that finished before its pull ended: True while the workers may still
        write its blocks (keep them until `process` reports it)."""
        pending = self._pending.get(request_id)
        if pending is not None and not pending.started:
            del self._pending[request_id]
            return False
        return pending is not None

    def process(self, report: HandoverReport | None) -> list[tuple[Request, PullResult]]:
        """The requests whose pulls ended, with how; counted."""
        if report is None:
            return []
        out = []
        self.counters.transport_bytes = max(self.counters.transport_bytes,
                                            report.transport_bytes)
        for result in report.results:
            pending = self._pending.pop(result.request_id, None)
            if pending is None:
                continue
            c = self.counters
            c.transfer_seconds += result.seconds
            c.bytes_moved += result.num_bytes
            if result.ok:
                c.received += 1
                c.blocks_pulled += len(pending.job.pairs)
                c.blocks_skipped += pending.skipped
            else:
                c.failed += 1
            out.append((pending.request, result))
        return out

    @property
    def num_pulling(self) -> int:
        return len(self._pending)

    def stats(self) -> HandoverStats:
        c = self.counters
        return HandoverStats(
            offered=c.offered, received=c.received, failed=c.failed, bytes_moved=c.bytes_moved,
            transport_bytes=c.transport_bytes,
            blocks_pulled=c.blocks_pulled, blocks_skipped=c.blocks_skipped,
            lease_timeouts=c.lease_timeouts, leases_held=len(self._leases),
            transfer_seconds=c.transfer_seconds,
        )
