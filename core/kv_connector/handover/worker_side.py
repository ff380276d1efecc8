"""The handover's worker side (decode engines pull, prefill engines are read from).

Every rank registers its whole KV arena with the engine's transport at start, so a peer
can read any block of it. On the decode side the step carries `PullJob`s: for each (peer
block, our block) pair the rank reads that block id's page in every arena slot, from the
peer rank of the same index, in one background read per job; `report()` polls them.

Tensor parallel: every rank pulls its own shard (rank r of the decode engine reads rank r
of the prefill engine), and a pull ends on every rank at once: the ranks agree through
the TP group's communicator on which jobs are done (all of them done), failed (any of
them failed or timed out) or still running, so the scheduler's report (the output rank's)
speaks for every rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tokenmill.platforms.kv_handover import (
    ArenaGeometry,
    EngineEndpoint,
    HandoverReport,
    HandoverStepMeta,
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
    handle: object | None
    started: float
    num_bytes: int
    error: str = ""
    done: bool = False  # the read completed here (polled once: a handle is done once)


class HandoverWorker:
    """One rank's transport over its arena. `communicator`: the TP group's (None: one
    rank), through which the ranks agree on every pull's end."""

    def __init__(
        self, transport: KVTransport, buffer: torch.Tensor, geometry: ArenaGeometry,
        rank: int = 0, communicator=None,
    ) -> None:
        self.transport = transport
        self.geometry = geometry
        self.rank = rank
        self.communicator = communicator
        self.base = buffer.data_ptr()
        transport.register(self.base, buffer.numel() * buffer.element_size())
        self._peers: dict[str, tuple[str, RankEndpoint]] = {}  # engine id -> (peer id, rank)
        self._pulls: list[_Pull] = []  # in the order the steps sent them (same on every rank)

    def endpoint(self) -> RankEndpoint:
        return RankEndpoint(self.transport.descriptor(), self.base, self.geometry)

    def apply(self, meta: HandoverStepMeta) -> None:
        """Connect to new peers, then start the step's pulls (they run in the background
        while the step's forward pass computes other requests)."""
        for peer in meta.peers:
            self._connect(peer)
        for job in meta.pulls:
            self._start(job)

    def _connect(self, peer: EngineEndpoint) -> None:
        if peer.engine_id in self._peers:
            return
        if self.rank >= len(peer.ranks):
            raise ValueError(f"peer {peer.engine_id} has {len(peer.ranks)} ranks; rank "
                             f"{self.rank} has none to pull from")
        remote = peer.ranks[self.rank]
        self._peers[peer.engine_id] = (self.transport.connect(remote.descriptor), remote)

    def regions(self, job: PullJob, remote: RankEndpoint) -> list[Region]:
        """(local, remote, length) of every part of every block of `job`."""
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
        try:
            peer_id, remote = self._peers[job.engine_id]
            regions = self.regions(job, remote)
            handle = self.transport.start_read(peer_id, regions)
            self._pulls.append(_Pull(job, handle, now, sum(r[2] for r in regions)))
        except (KeyError, ValueError, TransportError) as exc:
            logger.warning("handover %s: the pull from %s could not start: %s",
                           job.request_id, job.engine_id, exc)
            self._pulls.append(_Pull(job, None, now, 0, f"could not start: {exc}"))

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
            if self.transport.poll(pull.handle):
                pull.done = True
                return _DONE
        except TransportError as exc:
            pull.error = str(exc)
            return _FAILED
        if time.monotonic() - pull.started > pull.job.deadline_s:
            self.transport.cancel(pull.handle)
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
                    self.transport.cancel(pull.handle)  # another rank failed: ours is moot
                pull.error = "failed on another rank"
            if state == _FAILED:
                logger.warning("handover %s: the pull from %s failed: %s",
                               pull.job.request_id, pull.job.engine_id, pull.error)
            out.results.append(PullResult(pull.job.request_id, state == _DONE, n,
                                          now - pull.started, pull.error))
        done = {id(p) for p, _ in ended}
        self._pulls = [p for p in self._pulls if id(p) not in done]
        return out

    def close(self) -> None:
        for pull in self._pulls:
            if pull.handle is not None and not pull.done and not pull.error:
                self.transport.cancel(pull.handle)
        self._pulls.clear()
        self.transport.close()


def make_handover_worker(transport_name: str, engine_id: str, rank: int, arena,
                         device: str, parallel_state) -> HandoverWorker:
    """A rank's handover worker over the core runner's `arena` (core/kv/arena.py), its
    transport named `{engine_id}-r{rank}`; with tensor parallel, its ranks agree through
    the TP group's communicator."""
    from tokenmill.kv_connector.handover.transports import make_transport
    from tokenmill.platforms.kv_transport import TransportContext

    geometry = ArenaGeometry(arena.num_blocks, arena.page_bytes, arena.num_slots,
                             1 if arena.block_major else 2)
    transport = make_transport(transport_name, TransportContext(f"{engine_id}-r{rank}",
                                                                device=device))
    tp = parallel_state.group("tp")
    return HandoverWorker(transport, arena.buffer, geometry, rank, tp.communicator)
