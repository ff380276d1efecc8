"""Per-block cost of KV offload: save (copy out of the arena, frame + checksum, write to
the tier) and load (read, check, copy into the arena), per tier, in one run.

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
import tempfile
import time

import torch

from tokenmill.kv_connector.disk import DiskTier
from tokenmill.kv_connector.host import HostMemoryTier
from tokenmill.kv_connector.messages import BlockTransfer, LoadJob
from tokenmill.kv_connector.objects import KVLayout, object_key
from tokenmill.kv_connector.stack import TierStack
from tokenmill.kv_connector.worker import KVConnectorWorker
from tokenmill.platforms.interfaces import AllocatorPurpose
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


def bench(name: str, n: int, url: str | None) -> tuple[float, float]:
    layout = KVLayout("bench", "bfloat16", BS, ((2, BS, KV_HEADS, HEAD),) * LAYERS, 2)
    caches = [torch.randn(2, n, BS, KV_HEADS, HEAD).to(torch.bfloat16) for _ in range(LAYERS)]
    best_save = best_load = float("inf")
    for run in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            stack = TierStack([tier_of(name, layout, n, tmp, url)])
            worker = KVConnectorWorker(stack, layout)
            worker.register_kv_caches(caches)
            fp = layout.fingerprint()
            blocks = [BlockTransfer(i, object_key(fp, bytes([run]) + i.to_bytes(31, "little")))
                      for i in range(n)]
            t0 = time.perf_counter()
            for i in range(0, n, 8):  # 8 blocks a step, as a prefill chunk fills them
                worker.save(blocks[i : i + 8])
            worker.drain()
            best_save = min(best_save, (time.perf_counter() - t0) / n)
            t0 = time.perf_counter()
            worker.start_loads([LoadJob("r", blocks)])
            (result,) = worker.drain().loads
            assert result.num_loaded == n
            best_load = min(best_load, (time.perf_counter() - t0) / n)
            worker.close()
            stack.close()
    return best_save, best_load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--redis-url", default=None)
    args = p.parse_args()
    size = 2 * BS * KV_HEADS * HEAD * 2 * LAYERS
    print(f"| tier | save us/block | load us/block | save GB/s | load GB/s |  ({size} B/block)")
    print("|---|---|---|---|---|")
    for name in ("host", "disk") + (("redis",) if args.redis_url else ()):
        s, ld = bench(name, args.blocks, args.redis_url)
        print(f"| {name} | {s * 1e6:.0f} | {ld * 1e6:.0f} | {size / s / 1e9:.2f} | {size / ld / 1e9:.2f} |")


if __name__ == "__main__":
    main()
