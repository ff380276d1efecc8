"""What a prefill/decode handover carries between an engine core and its workers, and
how one engine's KV arena is reached by another's (msgspec Structs: plain data, msgpack
on the wire, never pickle; core/kv_connector/handover/ builds and reads them).

- `EngineEndpoint`: how to reach an engine's KV arena through its transport, per rank,
  and what must match for a handover (model, dtype, block size, KV layout; the tensor
  parallel size too, unless every KV group's pages can be resharded: `PageShard`).
- `PullJob` / `HandoverStepMeta` (engine core -> workers, in `StepDescription.kv_handover`)
  and `PullResult` / `HandoverReport` (workers -> engine core, in `StepResult.kv_handover`):
  a decode engine's reads of a prefill engine's blocks.
"""

from __future__ import annotations

import msgspec


class ArenaGeometry(msgspec.Struct, frozen=True):
    """How one rank's KV arena lays out its bytes (core/kv/arena.py): `num_slots` regions of
    `num_blocks` pages of `page_bytes`, each page in `halves` contiguous parts (2: keys then
    values, far apart; 1: block-major). Block b of slot s, half h starts at
    s * num_blocks * page_bytes + h * num_blocks * (page_bytes // halves)
    + b * (page_bytes // halves) from the arena's base address."""

    num_blocks: int
    page_bytes: int
    num_slots: int
    halves: int

    def regions(self, base: int, block_id: int) -> list[tuple[int, int]]:
        """(address, length) of every part of block `block_id`, slot then half order."""
        half = self.page_bytes // self.halves
        slot_bytes = self.num_blocks * self.page_bytes
        return [
            (base + s * slot_bytes + h * self.num_blocks * half + block_id * half, half)
            for s in range(self.num_slots) for h in range(self.halves)
        ]

    @property
    def block_bytes(self) -> int:
        """Bytes one block id names over every slot (what a transfer of it moves)."""
        return self.page_bytes * self.num_slots


class PageShard(msgspec.Struct, frozen=True):
    """How one KV group's pages split over tensor parallel ranks, as one rank holds them.

    - "heads": each page half (keys, values) is [rows, heads, head_bytes] bytes, the
      standard layout [block_size, KV heads, head_size]; this rank holds the model's KV
      heads [head_start, head_start + heads) of `total_heads` (a head replicated on
      several ranks when there are fewer heads than ranks).
    - "replicated": every rank holds the whole page (MLA latent rows).
    - "state": a recurrent state packed from this rank's rows of each state tensor, whose
      runs split evenly over the ranks (`StateTensorSpec.parts`); every rank's layout
      follows from the model's whole state spec and the tp size.
    - "fixed": laid out for one tensor parallel size in a way the core cannot reshard
      (a recurrent state whose family declares no runs; a backend's own page layout):
      only a peer of the same tensor parallel size reads it.
    """

    kind: str
    rows: int = 0
    heads: int = 0
    head_bytes: int = 0
    head_start: int = 0
    total_heads: int = 0


class RankEndpoint(msgspec.Struct, frozen=True):
    """One worker rank: its transport's descriptor and where its arena starts."""

    descriptor: bytes
    base_address: int
    geometry: ArenaGeometry
    shards: list[PageShard] = []  # per KV group, in group order


class EngineEndpoint(msgspec.Struct, frozen=True):
    """An engine as a handover peer. The decode side refuses a peer whose `model`, `dtype`,
    `kv_cache_dtype`, `kv_scales`, `block_size` or `layout` differs from its own, naming
    it, and one of another `tensor_parallel_size` unless every KV group's pages can be
    resharded (`reshard_problems`)."""

    engine_id: str
    transport: str  # the KV transport's name (both sides must use the same one)
    model: str  # the model's identity: a digest of its config (not of its path)
    dtype: str
    block_size: int
    # a digest of the KV groups (kinds, windows, layer counts) and of their pages whatever
    # the tensor parallel size (`PageShard`: total heads, head bytes, rows)
    layout: str
    tensor_parallel_size: int
    ranks: list[RankEndpoint]  # in rank order
    # torch dtype name of what the KV pages hold ("float8_e4m3fn" for an FP8 cache; the
    # compute dtype otherwise): a bf16 and an FP8 engine cannot read each other's pages
    kv_cache_dtype: str = ""
    # a digest of the KV scales when calibrated at start (calculate_kv_scales), else "":
    # FP8 pages read right only with the scales they were written with
    kv_scales: str = ""


def compatibility_problems(local: EngineEndpoint, peer: EngineEndpoint) -> list[str]:
    """What differs between two engines that a handover needs equal (empty: compatible).
    A different tensor parallel size is a problem only where the pages cannot be
    resharded (`reshard_problems`)."""
    problems = []
    for field in ("transport", "model", "dtype", "kv_cache_dtype", "kv_scales", "block_size",
                  "layout"):
        mine, theirs = getattr(local, field), getattr(peer, field)
        if mine != theirs:
            problems.append(f"{field}: {theirs!r} on {peer.engine_id}, {mine!r} here")
    if local.tensor_parallel_size != peer.tensor_parallel_size:
        problems += reshard_problems(local, peer)
    return problems


def reshard_problems(local: EngineEndpoint, peer: EngineEndpoint) -> list[str]:
    """Why `local` cannot read `peer`'s pages at another tensor parallel size (empty: every
    KV group's heads split over both sides' ranks, or are replicated). Each problem starts
    with `tensor_parallel_size: ` and the two sizes, then names the group and what blocks
    it."""
    head = (f"tensor_parallel_size: {peer.tensor_parallel_size!r} on {peer.engine_id}, "
            f"{local.tensor_parallel_size!r} here")
    if not local.ranks or not peer.ranks or any(
            len(r.shards) != len(local.ranks[0].shards) for r in [*local.ranks, *peer.ranks]):
        return [f"{head}: the endpoints do not say how their pages split over ranks"]
    problems = []
    for g, (mine, theirs) in enumerate(zip(local.ranks[0].shards, peer.ranks[0].shards,
                                           strict=True)):
        if "fixed" in (mine.kind, theirs.kind):
            problems.append(f"{head}: KV group {g} keeps pages laid out for one tensor "
                            "parallel size (recurrent states, or a backend's own layout), "
                            "which cannot be resharded")
        elif mine.kind != theirs.kind:
            problems.append(f"{head}: KV group {g} is {theirs.kind!r} there, {mine.kind!r} here")
        elif mine.kind == "heads":
            for field in ("total_heads", "head_bytes", "rows"):
                a, b = getattr(mine, field), getattr(theirs, field)
                if a != b:
                    problems.append(f"{head}: KV group {g} has {field} {b} there, {a} here")
            held = {h for r in peer.ranks for h in range(
                r.shards[g].head_start, r.shards[g].head_start + r.shards[g].heads)}
            if held != set(range(mine.total_heads)):
                problems.append(f"{head}: KV group {g}'s ranks there hold heads "
                                f"{sorted(held)}, not all {mine.total_heads}")
    return problems


class PullJob(msgspec.Struct, frozen=True):
    """Read blocks of a peer's arena into ours: (peer block id, our block id) pairs; each
    pair moves the block id's page in every arena slot."""

    request_id: str
    engine_id: str
    pairs: list[tuple[int, int]]
    deadline_s: float  # give up (and recompute) after this long
    # the KV group of each pair (what its pages hold: which `PageShard` splits them when
    # the peer's tensor parallel size differs); empty: not needed (same size)
    groups: list[int] = []


class HandoverStepMeta(msgspec.Struct, kw_only=True):
    """The handover's part of one step (decode side)."""

    peers: list[EngineEndpoint] = []  # peers not yet sent to the workers: connect first
    pulls: list[PullJob] = []  # to start now, in the background


class PullResult(msgspec.Struct, frozen=True):
    """How one request's pull ended (`ok`, else `error` says why), reported by the worker."""

    request_id: str
    ok: bool
    num_bytes: int  # bytes the transport moved for it (every rank together)
    seconds: float
    error: str = ""


class HandoverReport(msgspec.Struct, kw_only=True):
    """Pulls that ended since the worker's last report."""

    results: list[PullResult] = []
    # what the transports themselves counted as read, every rank together, since start
    transport_bytes: int = 0
