"""Per-block cost and bandwidth of KV offload, per tier, in one run, beside the machine's
own memory copy and disk read bandwidth.

- save: into the host, a device eviction's move (copy the pages out of the arena into
  host slots, frame + checksum); into disk or Redis, a save (copy out, frame + checksum,
  write the object).
- load: one batched job of every block (read, check, scatter into the arena), as a
  request's load is: the host's slots in place, the disk's files `readinto` staging rows
  by 4 I/O threads (from the page cache, and cold: each file dropped from the cache with
  posix_fadvise first), Redis in one MGET.

    python benchmarks/bench_kv_offload.py [--blocks 256] [--redis-url redis://127.0.0.1:6379]

Layout: SmolLM2-135M's (30 layers, 3 KV heads, head size 64, bf16) at block size 16: one
object is every layer's page of one block, 368,640 bytes of payload. The host tier is a slab from
the CPU plugin's host-staging allocator; the disk tier writes files in a temp directory
(the page cache absorbs them: this is the engine's cost, not the drive's); Redis is
whatever server --redis-url names (skipped without one). Times are per block, the
minimum over 3 runs; the worker thread runs these off the engine's step thread.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from tokenmill.kv_connector.disk import DiskTier
from tokenmill.kv_connector.host import HostMemoryTier
from tokenmill.kv_connector.objects import KVLayout, ObjectCodec, object_key
from tokenmill.kv_connector.stack import TierStack
from tokenmill.kv_connector.worker import KVConnectorWorker
from tokenmill.platforms.interfaces import AllocatorPurpose
from tokenmill.platforms.kv_messages import BlockTransfer, EvictedBlock, LoadJob
from tokenmill_cpu.allocator import make_allocator

LAYERS, KV_HEADS, HEAD, BS = 30, 3, 64, 16


def tier_of(name: str, layout: KVLayout, n: int, tmp: str, url: str | None):
    if name == "host":
        return HostMemoryTier(make_allocator(AllocatorPurpose.HOST_STAGING),
                              n * layout.object_bytes, layout.object_bytes)
    if name == "disk":
        return DiskTier(tmp, n * layout.object_bytes)
    from tokenmill.kv_connector.redis_tier import RedisTier

    tier = RedisTier(url)
    tier._client.flushdb()
    return tier


def bench(name: str, n: int, url: str | None, cold: bool = False) -> tuple[float, float]:
    page = 2 * BS * KV_HEADS * HEAD * 2  # one layer's K and V of a block, bytes
    layout = KVLayout("bench", "bfloat16", BS, ((2, page // 2),) * LAYERS, 1)
    arena = torch.randint(0, 256, (LAYERS * n * page,), dtype=torch.uint8)  # as KVArena's
    rows = [arena[s * n * page : (s + 1) * n * page].view(2, n, page // 2) for s in range(LAYERS)]
    best_save = best_load = float("inf")
    for run in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            tier = tier_of(name, layout, n, tmp, url)
            stack = TierStack([tier], ObjectCodec(layout.payload_bytes))
            worker = KVConnectorWorker(stack, layout)
            worker.register_page_rows(rows)
            fp = layout.fingerprint()
            blocks = [BlockTransfer(i, object_key(fp, bytes([run]) + i.to_bytes(31, "little")))
                      for i in range(n)]
            t0 = time.perf_counter()
            for i in range(0, n, 8):  # 8 blocks a step, as a prefill chunk fills them
                if name == "host":
                    worker.demote([EvictedBlock(b.block_id, b.key, 1.0) for b in blocks[i : i + 8]])
                else:
                    worker.save(blocks[i : i + 8])
            worker.drain()
            best_save = min(best_save, (time.perf_counter() - t0) / n)
            if cold:
                for b in blocks:
                    fd = os.open(tier.file_for(b.key), os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
            t0 = time.perf_counter()
            worker.start_loads([LoadJob("r", blocks)])
            (result,) = worker.drain().loads
            assert result.num_loaded == n
            best_load = min(best_load, (time.perf_counter() - t0) / n)
            worker.close()
            stack.close()
    return best_save, best_load


def machine_bandwidth(nbytes: int) -> tuple[float, float]:
    """The machine's memory copy and cold sequential disk read, bytes/s."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    with tempfile.NamedTemporaryFile() as f:
        f.write(src.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(nbytes)
        t0 = time.perf_counter()
        with open(f.name, "rb", buffering=0) as g:
            g.readinto(buf)
        disk = nbytes / (time.perf_counter() - t0)
    return nbytes / best, disk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--redis-url", default=None)
    args = p.parse_args()
    size = 2 * BS * KV_HEADS * HEAD * 2 * LAYERS
    memory, disk = machine_bandwidth(args.blocks * size)
    print(f"machine: memory copy {memory / 1e9:.2f} GB/s, cold disk read {disk / 1e9:.2f} GB/s "
          f"({args.blocks * size >> 20} MiB), load average {os.getloadavg()[0]:.1f}")
    print(f"| tier | save us/block | load us/block | load GB/s | of the machine's |  ({size} B/block)")
    print("|---|---|---|---|---|")
    cases = [("host", False), ("disk", False), ("disk", True)]
    cases += [("redis", False)] if args.redis_url else []
    for name, cold in cases:
        s, ld = bench(name, args.blocks, args.redis_url, cold)
        ref, what = (disk, "disk read") if cold else (memory, "memory copy")
        label = f"{name} (cold)" if cold else name
        print(f"| {label} | {s * 1e6:.0f} | {ld * 1e6:.0f} | {size / ld / 1e9:.2f} | "
              f"{size / ld / ref:.0%} of {what} |")


if __name__ == "__main__":
    main()
