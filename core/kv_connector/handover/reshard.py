"""Resharding a handover between engines of different tensor parallel sizes (tp 2 prefill
-> tp 1 decode, and the reverse): which peer ranks hold each of this rank's KV heads, and
the byte regions that read them.

Every rank describes, per KV group, how its pages split over ranks (`PageShard`): a
multi-head page half is [block_size, heads, head_size] with this rank's heads only, an MLA
page is the same on every rank, a recurrent state ("state") packs this rank's rows of each
state tensor, whose runs (`StateTensorSpec.parts`: q, k, v conv channels, value heads)
split evenly over the ranks (Gated DeltaNet, Mamba2, KDA declare them); a state whose
family declares no runs, or whose rank layout is not their split, is "fixed" (only a peer
of the same size reads it). A decode rank reads, for each of its heads or state rows, the
first peer rank that holds it (one source, so every byte is moved once whatever the
sizes), and a replicated page from one peer rank. Both sides derive a rank's state layout
from the model's whole spec (the same model: the handshake checks it).

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
from tokenmill.platforms.interfaces import (
    AttentionKind,
    AttentionSpec,
    RecurrentStateSpec,
    StateTensorSpec,
    kv_cache_shape,
)
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
        found = {_shard(global_specs[i], local_specs[i],
                        backends[i] if backends is not None else None, tp, rank, page_bytes)
                 for i in layers}
        shard, why = found.pop() if len(found) == 1 else (PageShard("fixed"), "its layers differ")
        if why and rank == 0:
            logger.info("KV group %d: pages laid out for tp %d only (%s); a handover from or "
                        "to another tp size refuses it", g, tp, why)
        out.append(shard)
    return out


def _shard(whole: AttentionSpec, local: AttentionSpec, backend, tp: int, rank: int,
           page_bytes: int) -> tuple[PageShard, str]:
    """The layer's `PageShard`, and why it is "fixed" ("" otherwise)."""
    if local.kind == AttentionKind.MLA:
        return PageShard("replicated"), ""
    if local.kind == AttentionKind.LINEAR:
        split = rank_state(whole.state, tp) if whole.state is not None else None
        if split is not None and split == local.state:
            return PageShard("state"), ""
        variant = local.state.variant if local.state is not None else "recurrent"
        if split is None:
            return PageShard("fixed"), (f"a {variant} state whose tensor parallel runs are "
                                        f"not declared or do not split over {tp} ranks")
        return PageShard("fixed"), (f"a {variant} state laid out otherwise than its declared "
                                    f"runs split over {tp} ranks")
    if local.kind not in (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW):
        return PageShard("fixed"), f"attention kind {local.kind.value!r}"
    if backend is not None and tuple(backend.kv_cache_shape(local, 1)) != kv_cache_shape(local, 1):
        return PageShard("fixed"), f"{type(backend).__name__} declares its own page layout"
    heads = head_shards(whole.num_heads, whole.num_kv_heads, tp, rank)
    head_bytes = local.head_size * local.kv_dtype.itemsize
    if heads.num_kv_heads != local.num_kv_heads or (
            page_bytes != 2 * local.block_size * local.num_kv_heads * head_bytes):
        return PageShard("fixed"), (f"{local.num_kv_heads} KV heads in pages of {page_bytes} "
                                    "bytes, not the standard split")
    return PageShard("heads", rows=local.block_size, heads=local.num_kv_heads,
                     head_bytes=head_bytes, head_start=heads.kv_head_start,
                     total_heads=whole.num_kv_heads), ""


def rank_state(whole: RecurrentStateSpec, tp: int) -> RecurrentStateSpec | None:
    """A rank's state at tp `tp` (every rank's is the same shape): each tensor's runs split
    evenly. None: a tensor declares no runs, or they do not split."""
    tensors = []
    for t in whole.tensors:
        if not t.parts or sum(t.parts) != t.shape[0] or any(p % tp for p in t.parts):
            return None
        tensors.append(StateTensorSpec(t.name, (t.shape[0] // tp, *t.shape[1:]), t.dtype,
                                       tuple(p // tp for p in t.parts)))
    return RecurrentStateSpec(whole.variant, tuple(tensors))


def state_spans(whole: RecurrentStateSpec, tp: int, rank: int, peer_tp: int,
                ) -> list[tuple[int, int, int, int]]:
    """The packed-state bytes rank `rank` of `tp` reads from a peer of `peer_tp`: (peer
    rank, our byte offset, the peer's byte offset, length), each of our rows once."""
    mine, theirs = rank_state(whole, tp), rank_state(whole, peer_tp)
    if mine is None or theirs is None:
        raise ValueError(f"the {whole.variant} state does not split over {tp} and {peer_tp} ranks")
    out = []
    for t, at, peer_at in zip(whole.tensors, mine.offsets, theirs.offsets, strict=True):
        row = t.num_bytes // t.shape[0]
        local_row, peer_row = 0, 0  # where part i starts in our rows and in a peer rank's
        for part in t.parts:
            n, m = part // tp, part // peer_tp
            lo, hi = rank * n, (rank + 1) * n  # our rows of the part
            for q in range(lo // m, -(-hi // m)):
                a, b = max(lo, q * m), min(hi, (q + 1) * m)
                out.append((q, at + (local_row + a - lo) * row,
                            peer_at + (peer_row + a - q * m) * row, (b - a) * row))
            local_row, peer_row = local_row + n, peer_row + m
    return out


def _packed(geometry: ArenaGeometry, base: int, pages: list[int], slot: int,
            offset: int, length: int) -> list[tuple[int, int]]:
    """(address, length) pieces of bytes [offset, offset + length) of a state packed over
    `pages` in one slot: page after page, each page's halves in order (kv_state.py)."""
    piece = geometry.page_bytes // geometry.halves
    out = []
    while length:
        k, within = divmod(offset, piece)
        j, h = divmod(k, geometry.halves)
        n = min(length, piece - within)
        start = geometry.regions(base, pages[j])[slot * geometry.halves + h][0]
        out.append((start + within, n))
        offset, length = offset + n, length - n
    return out


def _state_regions(spans, geometry: ArenaGeometry, base: int, pages: list[int],
                   peer: list[RankEndpoint], peer_pages: list[int]) -> dict[int, list[Region]]:
    """Every slot's regions of one state: `spans` (`state_spans`) cut where a page half
    ends on either side."""
    out: dict[int, list[Region]] = {}
    for slot in range(geometry.num_slots):
        for q, at, peer_at, n in spans:
            theirs = peer[q]
            dst = _packed(geometry, base, pages, slot, at, n)
            src = _packed(theirs.geometry, theirs.base_address, peer_pages, slot, peer_at, n)
            into = out.setdefault(q, [])
            while dst and src:
                (d, dn), (s, sn) = dst[0], src[0]
                k = min(dn, sn)
                into.append((d, s, k))
                dst[0], src[0] = (d + k, dn - k), (s + k, sn - k)
                if dn == k:
                    dst.pop(0)
                if sn == k:
                    src.pop(0)
    return out


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
    """How this rank (`rank` of `tp`, holding `shards`, arena `geometry` at `base`) reads a
    peer of another tensor parallel size (`peer`: its ranks in order).

    A replicated page (MLA latents), which every one of our ranks holds whole, is read
    once, by our rank 0, from the peer's rank 0; `shared_blocks` names the blocks whose
    pages our rank 0 then broadcasts over the TP group (worker_side.py), so the transport
    moves each of them once whatever the sizes."""

    def __init__(self, rank: int, base: int, geometry: ArenaGeometry, shards: list[PageShard],
                 peer: list[RankEndpoint], states: list[RecurrentStateSpec | None] | None = None,
                 tp: int = 1) -> None:
        theirs = peer[0].geometry
        if (geometry.num_slots, geometry.halves) != (theirs.num_slots, theirs.halves):
            raise ValueError(f"peer arena {theirs} does not lay out its slots like ours {geometry}")
        self.base, self.geometry, self.shards, self.peer = base, geometry, shards, peer
        self.rank, self.tp = rank, tp
        # per group: the runs of our heads and their peer ranks, or the one peer rank a
        # replicated page is read from (none on our ranks but 0: it shares them)
        self.sources: list[list[Segment]] = []
        for g, mine in enumerate(shards):
            peers = [r.shards[g] for r in peer]
            if mine.kind == "heads":
                self.sources.append(head_segments(mine, peers))
            elif mine.kind == "replicated":
                self.sources.append([Segment(0, 0, 0, 0)] if rank == 0 else [])
            else:
                self.sources.append([])  # refused at the handshake; a pull of it fails
        # per group: a recurrent state's spans (`state_spans`), else None
        self.spans = [
            state_spans(states[g], tp, rank, len(peer))
            if mine.kind == "state" and states and states[g] is not None else None
            for g, mine in enumerate(shards)
        ]

    def regions(self, job: PullJob) -> dict[int, list[Region]]:
        """Per peer rank, the (local, remote, length) regions of `job`'s blocks."""
        if len(job.groups) != len(job.pairs):
            raise ValueError(f"pull {job.request_id} names the KV groups of {len(job.groups)} "
                             f"of its {len(job.pairs)} block pairs; resharding needs each")
        out: dict[int, list[Region]] = {}
        states: dict[int, tuple[list[int], list[int]]] = {}  # group -> (our pages, theirs)
        for (remote_block, local_block), g in zip(job.pairs, job.groups, strict=True):
            if not 0 <= g < len(self.shards):
                raise ValueError(f"pull {job.request_id} names KV group {g}; this rank's "
                                 f"pages describe {len(self.shards)} groups")
            mine = self.shards[g]
            if self.spans[g] is not None:  # one state's pages, in table order
                pages = states.setdefault(g, ([], []))
                pages[0].append(local_block)
                pages[1].append(remote_block)
                continue
            if mine.kind == "replicated" and self.rank != 0:
                continue  # rank 0 reads it and shares it (`shared_blocks`)
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
        for g, (pages, peer_pages) in states.items():
            reads = _state_regions(self.spans[g], self.geometry, self.base, pages, self.peer,
                                   peer_pages)
            for q, regions in reads.items():
                out.setdefault(q, []).extend(regions)
        return out


    def shared_blocks(self, job: PullJob) -> list[int]:
        """Our blocks of `job` whose pages every one of our ranks holds whole (replicated
        groups): rank 0 reads them, then broadcasts them over the TP group. Empty at tp 1."""
        if self.tp == 1:
            return []
        return [local for (_, local), g in zip(job.pairs, job.groups, strict=True)
                if 0 <= g < len(self.shards) and self.shards[g].kind == "replicated"]


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

