"""The handover's worker side (decode engines pull, prefill engines are read from).

Every rank registers its whole KV arena with the engine's transport at start, so a peer
can read any block of it. On the decode side the step carries `PullJob`s: for each (peer
block, our block) pair the rank reads that block id's page in every arena slot, from the
peer rank of the same index, in one background read per job; `report()` polls them.

Tensor parallel: every rank pulls its own shard (rank r of the decode engine reads rank r
of the prefill engine; with another tp size there, the peer ranks that hold its heads,
reshard.py), and a pull ends on every rank at once: the ranks agree through
the TP group's communicator on which jobs are done (all of them done), failed (any of
them failed or timed out) or still running, so the scheduler's report (the output rank's)
speaks for every rank. With another tp size there, pages every rank holds whole (MLA) are
read by rank 0 alone and broadcast to the others once the pull is agreed done.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tokenmill.kv_connector.handover.reshard import ReshardPlan
from tokenmill.platforms.interfaces import RecurrentStateSpec
from tokenmill.platforms.kv_handover import (
    ArenaGeometry,
    EngineEndpoint,
    HandoverReport,
    HandoverStepMeta,
    PageShard,
    PullJob,
    PullResult,
    RankEndpoint,
)
from tokenmill.platforms.kv_transport import KVTransport, Region, TransportError

logger = logging.getLogger(__name__)

_RUNNING, _DONE, _FAILED = 0, 1, -1


@dataclass(slots=True)
class _Pull:
    job: PullJob
    handles: list[object]  # one read per peer rank it reads from
    started: float
    num_bytes: int
    error: str = ""
    done: bool = False  # every read completed here (polled once: a handle is done once)
    pending: list[object] | None = None  # the handles not yet seen done

    def __post_init__(self) -> None:
        self.pending = list(self.handles)


@dataclass(slots=True)
class _Peer:
    endpoint: EngineEndpoint
    ids: dict[int, str]  # peer rank -> the transport's id for it, once connected
    plan: ReshardPlan | None  # None: the same tp size, rank r reads rank r


class HandoverWorker:
    """One rank's transport over its arena. `communicator`: the TP group's (None: one
    rank), through which the ranks agree on every pull's end."""

    def __init__(
        self, transport: KVTransport, buffer: torch.Tensor, geometry: ArenaGeometry,
        rank: int = 0, communicator=None, shards: list[PageShard] | None = None,
        states: list[RecurrentStateSpec | None] | None = None,
    ) -> None:
        self.transport = transport
        self.geometry = geometry
        self.rank = rank
        self.communicator = communicator
        self.shards = shards or []  # per KV group, how this rank holds its pages
        self.states = states or []  # per KV group, the model's whole recurrent state, if any
        self.base = buffer.data_ptr()
        self.buffer = buffer.view(-1).view(torch.uint8)  # the arena's bytes, for sharing
        transport.register(self.base, buffer.numel() * buffer.element_size())
        self._peers: dict[str, _Peer] = {}  # by engine id
        self._pulls: list[_Pull] = []  # in the order the steps sent them (same on every rank)

    @property
    def tp_size(self) -> int:
        return 1 if self.communicator is None else self.communicator.world_size

    def endpoint(self) -> RankEndpoint:
        return RankEndpoint(self.transport.descriptor(), self.base, self.geometry,
                            self.shards)

    def apply(self, meta: HandoverStepMeta) -> None:
        """Connect to new peers, then start the step's pulls (they run in the background
        while the step's forward pass computes other requests)."""
        for peer in meta.peers:
            self._connect(peer)
        for job in meta.pulls:
            self._start(job)

    def _connect(self, peer: EngineEndpoint) -> None:
        """Know `peer`; its ranks are connected on their first read. Raises ValueError when
        its pages cannot be resharded into ours (the handshake refused it already)."""
        if peer.engine_id in self._peers:
            return
        if len(peer.ranks) == self.tp_size:
            plan = None
        else:
            plan = ReshardPlan(self.rank, self.base, self.geometry, self.shards, peer.ranks,
                               self.states, self.tp_size)
            logger.info("handover: rank %d reshards %s's %d ranks into our %d", self.rank,
                        peer.engine_id, len(peer.ranks), self.tp_size)
        self._peers[peer.engine_id] = _Peer(peer, {}, plan)

    def _peer_id(self, peer: _Peer, rank: int) -> str:
        if rank not in peer.ids:
            peer.ids[rank] = self.transport.connect(peer.endpoint.ranks[rank].descriptor)
        return peer.ids[rank]

    def reads(self, job: PullJob) -> dict[int, list[Region]]:
        """Per peer rank, the (local, remote, length) regions `job` reads from it."""
        peer = self._peers[job.engine_id]
        if peer.plan is not None:
            return peer.plan.regions(job)
        return {self.rank: self.regions(job, peer.endpoint.ranks[self.rank])}

    def regions(self, job: PullJob, remote: RankEndpoint) -> list[Region]:
        """(local, remote, length) of every part of every block of `job`, from a peer rank
        that lays out its pages as ours (the same tp size)."""
        mine, theirs = self.geometry, remote.geometry
        if (mine.page_bytes, mine.num_slots, mine.halves) != (
                theirs.page_bytes, theirs.num_slots, theirs.halves):
            raise ValueError(f"peer pages {theirs} do not match ours {mine}")
        out: list[Region] = []
        for remote_block, local_block in job.pairs:
            for (dst, n), (src, _) in zip(mine.regions(self.base, local_block),
                                          theirs.regions(remote.base_address, remote_block),
                                          strict=True):
                out.append((dst, src, n))
        return out

    def _start(self, job: PullJob) -> None:
        now = time.monotonic()
        handles: list[object] = []
        try:
            reads = self.reads(job)
            peer = self._peers[job.engine_id]
            for rank, regions in reads.items():
                handles.append(self.transport.start_read(self._peer_id(peer, rank), regions))
            num_bytes = sum(r[2] for regions in reads.values() for r in regions)
            self._pulls.append(_Pull(job, handles, now, num_bytes))
        except (KeyError, ValueError, TransportError) as exc:
            logger.warning("handover %s: the pull from %s could not start: %s",
                           job.request_id, job.engine_id, exc)
            for handle in handles:
                self.transport.cancel(handle)
            self._pulls.append(_Pull(job, [], now, 0, f"could not start: {exc}"))

    @property
    def num_in_flight(self) -> int:
        return len(self._pulls)

    def report(self, wait_s: float = 0.0) -> HandoverReport | None:
        """The pulls that ended on every rank since the last report (None: none in
        flight). Waits up to `wait_s` for one to end when nothing else is to be done."""
        if not self._pulls:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            states = [self._poll(p) for p in self._pulls]
            agreed = self._agree(states)
            if any(s != _RUNNING for s in agreed) or time.monotonic() >= deadline:
                break
            time.sleep(0.0005)
        return self._collect(agreed)

    def _poll(self, pull: _Pull) -> int:
        if pull.error:
            return _FAILED
        if pull.done:
            return _DONE
        try:
            pull.pending = [h for h in pull.pending if not self.transport.poll(h)]
            if not pull.pending:
                pull.done = True
                return _DONE
        except TransportError as exc:
            pull.error = str(exc)
            self._cancel(pull)
            return _FAILED
        if time.monotonic() - pull.started > pull.job.deadline_s:
            self._cancel(pull)
            pull.error = f"no answer within {pull.job.deadline_s:.1f} s"
            return _FAILED
        return _RUNNING

    def _agree(self, states: list[int]) -> list[int]:
        """Every rank's states for the same pulls, combined: failed anywhere, else running
        anywhere, else done."""
        if self.communicator is None or self.communicator.world_size == 1:
            return states
        mine = torch.tensor(states, dtype=torch.int64)
        every = self.communicator.all_gather(mine.unsqueeze(0), dim=0)
        return [
            _FAILED if (col == _FAILED).any() else _RUNNING if (col == _RUNNING).any() else _DONE
            for col in every.unbind(1)
        ]

    def _collect(self, agreed: list[int]) -> HandoverReport:
        out = HandoverReport()
        ended = [(p, s) for p, s in zip(self._pulls, agreed, strict=True) if s != _RUNNING]
        if not ended:
            return out
        for pull, state in ended:
            if state == _DONE:
                self._share(pull.job)
        # the bytes of each pull, and what the transport counted, over every rank
        nbytes = [p.num_bytes if s == _DONE else 0 for p, s in ended]
        nbytes.append(self.transport.stats.bytes_read)
        if self.communicator is not None and self.communicator.world_size > 1:
            total = self.communicator.all_reduce(torch.tensor(nbytes, dtype=torch.int64))
            nbytes = [int(b) for b in total]
        out.transport_bytes = nbytes.pop()
        now = time.monotonic()
        for (pull, state), n in zip(ended, nbytes, strict=True):
            if state == _FAILED and not pull.error:
                if not pull.done:
                    self._cancel(pull)  # another rank failed: ours is moot
                pull.error = "failed on another rank"
            if state == _FAILED:
                logger.warning("handover %s: the pull from %s failed: %s",
                               pull.job.request_id, pull.job.engine_id, pull.error)
            out.results.append(PullResult(pull.job.request_id, state == _DONE, n,
                                          now - pull.started, pull.error))
        done = {id(p) for p, _ in ended}
        self._pulls = [p for p in self._pulls if id(p) not in done]
        return out

    def _share(self, job: PullJob) -> None:
        """Broadcast from rank 0 the pages of `job` that every rank holds whole and rank 0
        alone read (`ReshardPlan.shared_blocks`). Every rank runs this for the same jobs
        in the same order (the ended pulls are agreed), so the collectives match."""
        plan = self._peers[job.engine_id].plan
        blocks = plan.shared_blocks(job) if plan is not None else []
        if not blocks:
            return
        views = [self.buffer[addr - self.base:addr - self.base + n]
                 for b in blocks for addr, n in self.geometry.regions(self.base, b)]
        staged = torch.cat(views) if self.rank == 0 else torch.empty(
            sum(v.numel() for v in views), dtype=torch.uint8, device=self.buffer.device)
        staged = self.communicator.broadcast(staged, 0)
        if self.rank != 0:
            for view, part in zip(views, staged.split([v.numel() for v in views]), strict=True):
                view.copy_(part)

    def _cancel(self, pull: _Pull) -> None:
        """Give up the reads of `pull` still running (once)."""
        for handle in pull.pending:
            self.transport.cancel(handle)
        pull.pending = []

    def close(self) -> None:
        for pull in self._pulls:
            if not pull.done and not pull.error:
                self._cancel(pull)
        self._pulls.clear()
        self.transport.close()


def make_handover_worker(transport_name: str, engine_id: str, rank: int, arena,
                         device: str, parallel_state, shards: list[PageShard],
                         states: list[RecurrentStateSpec | None]) -> HandoverWorker:
    """A rank's handover worker over the core runner's `arena` (core/kv/arena.py), its
    transport named `{engine_id}-r{rank}`; with tensor parallel, its ranks agree through
    the TP group's communicator. `shards`: how it holds each KV group's pages
    (`reshard.page_shards`); `states`: each group's whole recurrent state spec (None:
    attention), from which a peer rank's state layout follows."""
    from tokenmill.kv_connector.handover.transports import make_transport
    from tokenmill.platforms.kv_transport import TransportContext

    geometry = ArenaGeometry(arena.num_blocks, arena.page_bytes, arena.num_slots,
                             1 if arena.block_major else 2)
    transport = make_transport(transport_name, TransportContext(f"{engine_id}-r{rank}",
                                                                device=device))
    tp = parallel_state.group("tp")
    return HandoverWorker(transport, arena.buffer, geometry, rank, tp.communicator, shards,
                          states)
