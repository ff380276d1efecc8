"""Wiring the connector into an engine: the layout of its arena, the tier stack its
arguments ask for, and both halves of the connector over it."""

from __future__ import annotations

import copy
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tokenmill.kv.groups import KVGroup
from tokenmill.kv_connector.directory import TierDirectory
from tokenmill.kv_connector.objects import KVLayout
from tokenmill.kv_connector.registry import OffloadConfig, build_stack
from tokenmill.kv_connector.scheduler_side import KVConnectorScheduler
from tokenmill.kv_connector.stack import TierStack
from tokenmill.kv_connector.worker import KVConnectorWorker
from tokenmill.platforms.interfaces import AllocatorPurpose
from tokenmill.platforms.kv_messages import TierIndex
from tokenmill.platforms.kv_tier import TierStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerOffload:
    """A worker's half: the tier stack and the loads and saves over its KV caches."""

    stack: TierStack
    layout: KVLayout
    worker_side: KVConnectorWorker

    def close(self) -> None:
        self.worker_side.close()
        self.stack.close()


@dataclass(slots=True)
class Offload:
    """The engine's view: the scheduler side over the worker's stack. With the worker in
    this process ("uni") `stack`, `layout` and `worker_side` are the worker's own; with
    worker processes ("mp") they are None and `directory` mirrors the worker's stack."""

    stack: TierStack | None
    layout: KVLayout | None
    scheduler_side: KVConnectorScheduler
    worker_side: KVConnectorWorker | None
    directory: TierDirectory | None = None

    def snapshot(self) -> dict[str, TierStats]:
        """A copy of every tier's counters, in stack order (for the metrics)."""
        if self.directory is not None:
            return self.directory.snapshot()
        return {name: copy.copy(stats) for name, stats in self.stack.stats.items()}


def model_identity(model_path: str, hf_config) -> str:
    """The model's name for object keys: its resolved path, its config, and the size and
    modification time of every file under it (a rewritten checkpoint gets new keys
    without hashing gigabytes of weights)."""
    path = Path(model_path).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.sha256(str(path).encode())
    h.update(hf_config.to_json_string().encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def offload_config(args) -> OffloadConfig | None:
    """The tiers EngineArgs ask for, or None without any. Raises ValueError naming a bad
    combination."""
    config = OffloadConfig(
        host_bytes=args.kv_offload_host_bytes,
        disk_path=None if args.kv_offload_disk_path is None else os.fspath(args.kv_offload_disk_path),
        disk_bytes=args.kv_offload_disk_bytes,
        remote=args.kv_offload_remote,
        mac_key=None if args.kv_offload_hmac_key is None
        else args.kv_offload_hmac_key.get_secret_value().encode(),
    )
    if not config.enabled:
        return None
    if not args.enable_prefix_caching:
        raise ValueError(
            "KV offload addresses blocks by their prefix-cache keys; it needs "
            "enable_prefix_caching=True"
        )
    return config


def make_worker_offload(
    config: OffloadConfig, model_path: str, hf_config, rows: list, platform, block_size: int,
    dtype: str, kv_scales: str = "",
) -> WorkerOffload:
    """A worker's tier stack and connector half over its arena's slots as bytes, `rows`
    (`KVArena.page_rows`); `dtype`: the model's KV dtype name, `kv_scales`: a digest of
    calibrated KV scales ("" when they are the checkpoint's or 1.0), both part of the
    fingerprint."""
    layout = KVLayout(
        model_id=model_identity(model_path, hf_config),
        dtype=dtype,
        block_size=block_size,
        layer_shapes=tuple((r.shape[0], r.shape[2]) for r in rows),
        itemsize=1,
        kv_scales=kv_scales,
    )
    staging = platform.allocator(AllocatorPurpose.HOST_STAGING)
    stack = build_stack(config, layout, lambda: staging)
    worker = KVConnectorWorker(stack, layout, staging)
    worker.register_page_rows(rows)
    logger.info(
        "KV offload: tiers %s, %d-byte objects (one block of every arena slot)",
        [t.name for t in stack.tiers], layout.object_bytes,
    )
    return WorkerOffload(stack, layout, worker)


def engine_offload(
    worker_offload: WorkerOffload, block_size: int, groups: tuple[KVGroup, ...] | None = None
) -> Offload:
    """The engine's view of an in-process worker's offload; `groups`: the engine's KV
    groups (each group's blocks are objects of their own)."""
    w = worker_offload
    side = KVConnectorScheduler(w.stack, w.layout.fingerprint(), block_size, groups)
    return Offload(w.stack, w.layout, side, w.worker_side)


def remote_engine_offload(index: TierIndex, groups: tuple[KVGroup, ...] | None = None) -> Offload:
    """The engine's view of the offload of a worker in another process, from the index
    its stack sent (`Worker.kv_offload_index`); later reports keep it up to date."""
    directory = TierDirectory(index)
    side = KVConnectorScheduler(directory, index.fingerprint, index.block_size, groups)
    logger.info("KV offload over worker processes: tiers %s, %s objects held at start",
                index.tiers, [len(k) for k in index.keys])
    return Offload(None, None, side, None, directory)
