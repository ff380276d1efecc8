"""Resharding a handover between engines of different tensor parallel sizes (tp 2 prefill
-> tp 1 decode, and the reverse): which peer ranks hold each of this rank's KV heads, and
the byte regions that read them.

Every rank describes, per KV group, how its pages split over ranks (`PageShard`): a
multi-head page half is [block_size, heads, head_size] with this rank's heads only, an MLA
page is the same on every rank, a recurrent state is packed per tp size ("fixed": its
tensors split by head inside, component by component, which the pages do not show). A
decode rank reads, for each of its heads, the first peer rank that holds it (one source,
so every byte is moved once whatever the sizes), and a replicated page from one peer rank.

Why no staging buffer: the transports take scatter lists of (local, remote, length)
regions, so a head slice that is not contiguous in the page (tp 2 -> tp 1: the peer's
heads land at an offset of every token row of ours; tp 1 -> tp 2: ours are an offset of
every token row of the peer's) is read straight into place as one region per token row.
Nothing is copied after the read, no second buffer is registered, and the transport moves
exactly this rank's heads. The price is `block_size` regions per page half instead of one;
where the slice is the whole row on both sides (same head counts) the rows merge back
into one region.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.model.parallel import head_shards
from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec, kv_cache_shape
from tokenmill.platforms.kv_handover import ArenaGeometry, PageShard, PullJob, RankEndpoint
from tokenmill.platforms.kv_transport import Region

logger = logging.getLogger(__name__)


def page_shards(layer_groups: Sequence[int], global_specs: Sequence[AttentionSpec],
                local_specs: Sequence[AttentionSpec], backends: Sequence | None, tp: int,
                rank: int, page_bytes: int) -> list[PageShard]:
    """Per KV group (`layer_groups[i]`: layer i's), how rank `rank` of `tp` holds its
    pages. `global_specs`: the model's layers (all heads); `local_specs`: this rank's;
    `backends`: each layer's (None: the standard layouts)."""
    out = []
    for g in range(max(layer_groups) + 1):
        layers = [i for i, gid in enumerate(layer_groups) if gid == g]
        shards = {_shard(global_specs[i], local_specs[i],
                         backends[i] if backends is not None else None, tp, rank, page_bytes)
                  for i in layers}
        out.append(shards.pop() if len(shards) == 1 else PageShard("fixed"))
    return out


def _shard(whole: AttentionSpec, local: AttentionSpec, backend, tp: int, rank: int,
           page_bytes: int) -> PageShard:
    if local.kind == AttentionKind.MLA:
        return PageShard("replicated")
    if local.kind not in (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW):
        return PageShard("fixed")
    if backend is not None and tuple(backend.kv_cache_shape(local, 1)) != kv_cache_shape(local, 1):
        return PageShard("fixed")  # the backend's own view of the bytes: heads not known
    heads = head_shards(whole.num_heads, whole.num_kv_heads, tp, rank)
    head_bytes = local.head_size * local.kv_dtype.itemsize
    if heads.num_kv_heads != local.num_kv_heads or (
            page_bytes != 2 * local.block_size * local.num_kv_heads * head_bytes):
        return PageShard("fixed")
    return PageShard("heads", rows=local.block_size, heads=local.num_kv_heads,
                     head_bytes=head_bytes, head_start=heads.kv_head_start,
                     total_heads=whole.num_kv_heads)


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of this rank's heads read from one peer rank."""

    peer_rank: int
    local_head: int  # the run's first head, counted in our page row
    peer_head: int  # the same head, counted in the peer rank's page row
    num_heads: int


def head_segments(mine: PageShard, peers: Sequence[PageShard]) -> list[Segment]:
    """Where each of our heads is read: the first peer rank holding it, in runs. Raises
    ValueError naming a head no peer rank holds."""
    out: list[Segment] = []
    for h in range(mine.heads):
        head = mine.head_start + h
        q = next((q for q, s in enumerate(peers) if s.head_start <= head < s.head_start + s.heads),
                 None)
        if q is None:
            raise ValueError(f"no peer rank holds KV head {head}")
        ph = head - peers[q].head_start
        last = out[-1] if out else None
        if last and last.peer_rank == q and last.local_head + last.num_heads == h and (
                last.peer_head + last.num_heads == ph):
            out[-1] = Segment(q, last.local_head, last.peer_head, last.num_heads + 1)
        else:
            out.append(Segment(q, h, ph, 1))
    return out


class ReshardPlan:
    """How this rank (`rank`, holding `shards`, arena `geometry` at `base`) reads a peer of
    another tensor parallel size (`peer`: its ranks in order)."""

    def __init__(self, rank: int, base: int, geometry: ArenaGeometry, shards: list[PageShard],
                 peer: list[RankEndpoint]) -> None:
        theirs = peer[0].geometry
        if (geometry.num_slots, geometry.halves) != (theirs.num_slots, theirs.halves):
            raise ValueError(f"peer arena {theirs} does not lay out its slots like ours {geometry}")
        self.base, self.geometry, self.shards, self.peer = base, geometry, shards, peer
        # per group: the runs of our heads and their peer ranks, or the one peer rank a
        # replicated page is read from (spread over the peer's ranks)
        self.sources: list[list[Segment]] = []
        for g, mine in enumerate(shards):
            peers = [r.shards[g] for r in peer]
            if mine.kind == "heads":
                self.sources.append(head_segments(mine, peers))
            elif mine.kind == "replicated":
                self.sources.append([Segment(rank % len(peer), 0, 0, 0)])
            else:
                self.sources.append([])  # refused at the handshake; a pull of it fails

    def regions(self, job: PullJob) -> dict[int, list[Region]]:
        """Per peer rank, the (local, remote, length) regions of `job`'s blocks."""
        if len(job.groups) != len(job.pairs):
            raise ValueError(f"pull {job.request_id} names the KV groups of {len(job.groups)} "
                             f"of its {len(job.pairs)} block pairs; resharding needs each")
        out: dict[int, list[Region]] = {}
        for (remote_block, local_block), g in zip(job.pairs, job.groups, strict=True):
            mine = self.shards[g]
            if not self.sources[g]:
                raise ValueError(f"KV group {g} ({mine.kind}) cannot be resharded")
            for seg in self.sources[g]:
                peer = self.peer[seg.peer_rank]
                parts = zip(self.geometry.regions(self.base, local_block),
                            peer.geometry.regions(peer.base_address, remote_block), strict=True)
                into = out.setdefault(seg.peer_rank, [])
                if mine.kind == "replicated":
                    for (dst, n), (src, m) in parts:
                        if n != m:
                            raise ValueError(f"replicated pages of {m} bytes there, {n} here")
                        into.append((dst, src, n))
                    continue
                theirs = peer.shards[g]
                for (dst, _), (src, _) in parts:
                    into += _head_rows(dst, src, mine, theirs, seg)
        return out


def _head_rows(dst: int, src: int, mine: PageShard, theirs: PageShard,
               seg: Segment) -> list[Region]:
    """One page half's regions of `seg`: a region per token row, or one for the whole
    half when the run is every head on both sides."""
    hb = mine.head_bytes
    if seg.num_heads == mine.heads == theirs.heads:
        return [(dst, src, mine.rows * mine.heads * hb)]
    n = seg.num_heads * hb
    return [(dst + (row * mine.heads + seg.local_head) * hb,
             src + (row * theirs.heads + seg.peer_head) * hb, n) for row in range(mine.rows)]

