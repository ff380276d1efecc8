"""What the connector's two halves tell each other each step (msgspec Structs: the
scheduler side runs in the engine core, the worker side beside each model runner, and
these cross the process boundary between them as plain data)."""

from __future__ import annotations

import msgspec

from tokenmill.platforms.kv_tier import TierStats


class BlockTransfer(msgspec.Struct, frozen=True):
    """One KV block to move: its page in the arena and its object key in the tiers."""

    block_id: int
    key: bytes  # 32-byte object key (objects.object_key)


class EvictedBlock(msgspec.Struct, frozen=True, array_like=True):
    """A cached block the device pool evicted this step: the worker moves its page into
    the host tier before the step overwrites it. `benefit`: the recompute it saves per
    byte (the device pool's score, `KVBlock.benefit`), which ranks it there too."""

    block_id: int
    key: bytes
    benefit: float = 0.0


class PrefetchJob(msgspec.Struct, frozen=True):
    """Objects a waiting request will load: copied from the durable tiers into the host
    tier, and kept there (pinned) until the scheduler releases the request (`unpin`)."""

    request_id: str
    keys: list[bytes]


class LoadJob(msgspec.Struct, frozen=True):
    """Blocks to load for one request, in prefix order: block i is usable only if every
    block before it loaded, so a failure at block i keeps blocks [0, i)."""

    request_id: str
    blocks: list[BlockTransfer]


class ConnectorStepMeta(msgspec.Struct, kw_only=True):
    """The connector's part of one step."""

    loads: list[LoadJob] = []  # to start now, in the background
    saves: list[BlockTransfer] = []  # blocks this step fills: save after its forward pass
    # cached blocks this step's allocations evicted: into the host tier before the forward
    demotes: list[EvictedBlock] = []
    # objects of waiting requests to copy into the host tier in the background
    prefetch: list[PrefetchJob] = []
    unpin: list[str] = []  # requests whose prefetched objects may be evicted again


class LoadResult(msgspec.Struct, frozen=True):
    """How a load job ended. `tiers[i]` names the tier block i came from."""

    request_id: str
    num_loaded: int  # leading blocks now in the arena; < len(job.blocks): failed there
    num_requested: int
    tiers: list[str]
    # per tier the job read from: bytes read and seconds spent (the cost model's bandwidth)
    tier_bytes: dict[str, int] = {}
    tier_seconds: dict[str, float] = {}


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
    object_bytes: int = 0  # header + payload of one object
    host_objects: int = 0  # objects the host tier holds at most (0: no host tier)


class WorkerReport(msgspec.Struct, kw_only=True):
    """What the worker side finished since its last report."""

    loads: list[LoadResult] = []
    saved_keys: list[bytes] = []  # saves done (written, or already held everywhere)
    failed_save_keys: list[bytes] = []  # saves no tier took (all unreachable or full)
    num_prefetched: int = 0  # objects copied into the host tier by prefetches
    demoted_keys: list[bytes] = []  # evicted blocks handled (moved to the host or not)
    # the step's forward pass: tokens computed and seconds (the cost model's compute rate)
    step_tokens: int = 0
    step_seconds: float = 0.0
    # only from a worker in its own process (the engine mirrors its stack):
    tier_changes: list[TierChange] = []  # in the order they happened
    tier_stats: dict[str, TierStats] | None = None  # the stack's counters now

    @property
    def empty(self) -> bool:
        return not (
            self.loads or self.saved_keys or self.failed_save_keys or self.num_prefetched
            or self.tier_changes or self.demoted_keys
        )
