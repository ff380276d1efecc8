"""What the connector's two halves tell each other each step (msgspec Structs: the
scheduler side runs in the engine core, the worker side beside each model runner, and
these cross the process boundary between them as plain data)."""

from __future__ import annotations

import msgspec

from tokenmill.kv_connector.tier import TierStats


class BlockTransfer(msgspec.Struct, frozen=True):
    """One KV block to move: its page in the arena and its object key in the tiers."""

    block_id: int
    key: bytes  # 32-byte object key (objects.object_key)


class LoadJob(msgspec.Struct, frozen=True):
    """Blocks to load for one request, in prefix order: block i is usable only if every
    block before it loaded, so a failure at block i keeps blocks [0, i)."""

    request_id: str
    blocks: list[BlockTransfer]


class ConnectorStepMeta(msgspec.Struct, kw_only=True):
    """The connector's part of one step."""

    loads: list[LoadJob] = []  # to start now, in the background
    saves: list[BlockTransfer] = []  # blocks this step fills: save after its forward pass
    # object keys to copy up into the fastest tier in the background (a returning session)
    prefetch: list[bytes] = []


class LoadResult(msgspec.Struct, frozen=True):
    """How a load job ended. `tiers[i]` names the tier block i came from."""

    request_id: str
    num_loaded: int  # leading blocks now in the arena; < len(job.blocks): failed there
    num_requested: int
    tiers: list[str]


class TierChange(msgspec.Struct, frozen=True, array_like=True):
    """One tier gained (`held`) or lost an object: how a stack in a worker process keeps
    the engine's mirror of it (directory.py) up to date."""

    tier: str
    key: bytes
    held: bool


class TierIndex(msgspec.Struct, frozen=True):
    """Everything a worker's stack holds, once at start (the disk tier keeps what earlier
    runs saved): the seed of the engine's mirror, with the layout fingerprint."""

    fingerprint: bytes
    block_size: int
    tiers: list[str]  # fastest first
    keys: list[list[bytes]]  # per tier, least recently used first where it knows
    stats: dict[str, TierStats]


class WorkerReport(msgspec.Struct, kw_only=True):
    """What the worker side finished since its last report."""

    loads: list[LoadResult] = []
    saved_keys: list[bytes] = []  # saves done (written, or already held everywhere)
    failed_save_keys: list[bytes] = []  # saves no tier took (all unreachable or full)
    num_prefetched: int = 0  # objects copied up into the fastest tier by prefetches
    # only from a worker in its own process (the engine mirrors its stack):
    tier_changes: list[TierChange] = []  # in the order they happened
    tier_stats: dict[str, TierStats] | None = None  # the stack's counters now

    @property
    def empty(self) -> bool:
        return not (
            self.loads or self.saved_keys or self.failed_save_keys or self.num_prefetched
            or self.tier_changes
        )
