"""The KV tiers one by one, the stack over them and the tier registry, on real storage:
a host slab from the CPU plugin's host-staging allocator, files in a tmp dir, a real
redis-server on loopback."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tokenmill.kv.hashing import hash_blocks
from tokenmill.kv_connector.disk import DiskTier
from tokenmill.kv_connector.host import HostMemoryTier
from tokenmill.kv_connector.objects import (
    HEADER_BYTES,
    CorruptObjectError,
    KVLayout,
    ObjectCodec,
    object_key,
)
from tokenmill.kv_connector.redis_tier import RedisTier
from tokenmill.kv_connector.registry import (
    OffloadConfig,
    build_stack,
    make_tier,
    parse_size,
    tier_context,
    tier_factories,
)
from tokenmill.kv_connector.stack import TierStack
from tokenmill.platforms.interfaces import AllocatorPurpose
from tokenmill.platforms.kit.host_allocator import HostAllocator
from tokenmill.platforms.kv_tier import TierUnavailableError

LAYOUT = KVLayout("tiny", "bfloat16", 4, ((2, 4, 2, 8),) * 3, 2)  # 3 layers, 384-byte pages
CODEC = ObjectCodec(LAYOUT.payload_bytes)
decode, encode = CODEC.decode, CODEC.encode


def staging(limit: int = 1 << 20) -> HostAllocator:
    return HostAllocator(AllocatorPurpose.HOST_STAGING, limit, "test", owner="test")


def obj(i: int) -> tuple[bytes, bytes]:
    """A key and an encoded object whose payload is determined by i."""
    key = object_key(LAYOUT.fingerprint(), i.to_bytes(32, "little"))
    payload = bytes((i * 7 + j) % 251 for j in range(LAYOUT.payload_bytes))
    return key, encode(key, payload)


def test_object_framing_detects_every_kind_of_damage():
    key, data = obj(1)
    assert bytes(decode(key, data)) == data[HEADER_BYTES:]
    flipped = bytearray(data)
    flipped[-1] ^= 1
    with pytest.raises(CorruptObjectError, match="checksum"):
        decode(key, bytes(flipped))
    with pytest.raises(CorruptObjectError, match="payload is"):
        decode(key, data[:-5])
    other, _ = obj(2)
    with pytest.raises(CorruptObjectError, match="holds key"):
        decode(other, data)
    with pytest.raises(CorruptObjectError, match="under a header"):
        decode(key, data[:10])


def test_keys_follow_the_prefix_chain_and_the_layout():
    tokens = list(range(40))
    a = hash_blocks(tokens, 4)
    b = hash_blocks(tokens[:20] + [999] + tokens[21:], 4)
    fp = LAYOUT.fingerprint()
    assert [object_key(fp, h) for h in a[:5]] == [object_key(fp, h) for h in b[:5]]
    assert all(object_key(fp, x) != object_key(fp, y) for x, y in zip(a[5:], b[5:]))
    other = KVLayout("tiny", "float32", 4, ((2, 4, 2, 8),) * 3, 4).fingerprint()
    assert object_key(fp, a[0]) != object_key(other, a[0])


def test_parse_size():
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("100GB") == 100 * 10**9
    assert parse_size("512 MiB") == 512 << 20
    assert parse_size("4096") == 4096 and parse_size(4096) == 4096
    assert parse_size("1.5KiB") == 1536
    for bad in ("lots", "-1GiB", "0", 0, True):
        with pytest.raises(ValueError):
            parse_size(bad, "kv_offload_host_bytes")


def test_host_tier_benefit_eviction_pins_and_allocator_accounting():
    """The host evicts the lowest clock + benefit first (GreedyDual, as the device pool),
    never a pinned object; a pinned object deleted stays readable to its pinner until
    the last unpin; the slab comes from the host-staging allocator."""
    alloc = staging()
    size = LAYOUT.object_bytes
    tier = HostMemoryTier(alloc, 3 * size + 10, size)
    assert alloc.bytes_in_use() == 3 * size
    objs = [obj(i) for i in range(6)]
    for (k, d), benefit in zip(objs[:3], (5.0, 1.0, 3.0)):
        assert tier.put(k, d, benefit)
    assert not tier.put(*objs[0])  # already held: nothing written
    assert tier.get(objs[0][0]) == objs[0][1]
    assert tier.put(*objs[3], 2.0)  # evicts objs[1], the lowest priority (1.0)
    assert set(tier.keys()) == {objs[0][0], objs[2][0], objs[3][0]}
    assert tier.clock == 1.0 and tier.num_evicted == 1
    tier.pin([objs[3][0]])  # the next lowest (2.0) is pinned: objs[2] (3.0) goes
    assert tier.put(*objs[4], 0.5)  # priority clock + 0.5 = 1.5
    assert set(tier.keys()) == {objs[0][0], objs[3][0], objs[4][0]}
    tier.delete(objs[3][0])  # pinned: reads as gone, its slot kept for the pinner
    assert not tier.contains(objs[3][0]) and tier.slot_of(objs[3][0]) is None
    assert tier.used_bytes() == 3 * size
    tier.unpin([objs[3][0]])
    assert tier.used_bytes() == 2 * size
    tier.pin([objs[0][0], objs[4][0], objs[5][0]])  # pins may precede the object
    assert tier.put(*objs[5]) and not tier.put(*obj(7))  # the free slot, then all pinned
    assert tier.used_bytes() <= tier.capacity_bytes
    tier.close()
    assert alloc.bytes_in_use() == 0
    with pytest.raises(ValueError, match="holds no KV object"):
        HostMemoryTier(alloc, size - 1, size)


def test_disk_tier_atomic_files_capacity_and_rescan(tmp_path):
    size = LAYOUT.object_bytes
    tier = DiskTier(tmp_path, 2 * size)
    objs = [obj(i) for i in range(3)]
    for k, d in objs:
        assert tier.put(k, d)
    assert tier.used_bytes() == 2 * size and tier.num_evicted == 1
    assert not tier.file_for(objs[0][0]).exists()
    assert bytes(tier.get(objs[2][0])) == objs[2][1]
    assert not list(tmp_path.glob("*/*.tmp"))  # writes went through a rename
    again = DiskTier(tmp_path, 2 * size)  # a new process on the same directory
    assert set(again.keys()) == {objs[1][0], objs[2][0]}
    assert bytes(again.get(objs[1][0])) == objs[1][1]
    smaller = DiskTier(tmp_path, size)  # a smaller budget evicts down to it at start
    assert smaller.used_bytes() == size


def test_redis_tier_round_trip_and_set_nx(redis_server):
    tier = RedisTier(redis_server.url)
    k, d = obj(5)
    assert tier.put(k, d) and not tier.put(k, d)
    assert tier.get(k) == d and tier.contains_many([k, obj(6)[0]]) == [True, False]
    assert tier.keys() == [k]
    tier.delete(k)
    assert tier.get(k) is None


def test_redis_tier_unavailable_fails_fast(redis_server):
    tier = RedisTier(redis_server.url, socket_timeout_s=0.5, retry_after_s=30)
    k, d = obj(1)
    tier.put(k, d)
    redis_server.kill()
    with pytest.raises(TierUnavailableError):
        tier.get(k)
    with pytest.raises(TierUnavailableError, match="down"):
        tier.contains(k)  # no second timeout while marked down


def test_stack_write_through_promotion_and_corruption(tmp_path, redis_server):
    """Saves go to the durable tiers (disk, remote), not the host, which holds only what
    is moved or prefetched into it; reads check and fall through; a remote hit is copied
    to disk; a killed remote leaves the others working."""
    size = LAYOUT.object_bytes
    host = HostMemoryTier(staging(), 2 * size, size)
    disk = DiskTier(tmp_path / "d", 10 * size)
    remote = RedisTier(redis_server.url)
    stack = TierStack([host, disk, remote], CODEC)
    assert stack.host is host and stack.durable == [disk, remote] and stack.save_tier == "disk"
    objs = [obj(i) for i in range(4)]
    for k, d in objs:
        assert stack.put(k, d) == ["disk", "redis"]
    assert stack.put(*objs[3]) == []  # held everywhere: written nowhere
    assert stack.stats["disk"].bytes_written == 4 * size and host.keys() == []
    assert stack.num_leading_hits([k for k, _ in objs] + [obj(9)[0], objs[0][0]]) == 4
    payload, tier = stack.get(objs[0][0])  # from disk, not promoted into the host
    assert tier == "disk" and bytes(payload) == objs[0][1][HEADER_BYTES:]
    assert host.keys() == [] and stack.stats["host"].bytes_promoted == 0
    assert stack.promote(objs[0][0]) and objs[0][0] in host.keys()  # a prefetch
    assert stack.stats["host"].bytes_promoted == size
    # corrupt the host copy in place, then the disk file: the read falls to redis
    host.slot_view(objs[0][0])[HEADER_BYTES + 3] ^= 0xFF
    path = disk.file_for(objs[0][0])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    payload, tier = stack.get(objs[0][0])
    assert tier == "redis" and bytes(payload) == objs[0][1][HEADER_BYTES:]
    assert stack.stats["host"].corrupt == 1 and stack.stats["disk"].corrupt == 1
    assert disk.contains(objs[0][0])  # the remote hit was copied back to disk
    # the kill of the remote tier: reads and saves go on with the others
    redis_server.kill()
    k, d = obj(7)
    assert stack.put(k, d) == ["disk"]
    assert stack.get(k)[1] == "disk" and stack.get(objs[3][0])[1] == "disk"
    assert stack.stats["redis"].errors >= 1


def test_registry_builds_the_stack_from_entry_points(tmp_path, redis_server):
    assert {"host", "disk", "redis", "valkey"} <= set(tier_factories())
    ctx = tier_context(LAYOUT, staging)
    config = OffloadConfig(
        host_bytes=parse_size("64KiB"), disk_path=str(tmp_path), disk_bytes=1 << 20,
        remote=redis_server.url.replace("redis://", "valkey://"),
    )
    stack = build_stack(config, LAYOUT, staging)
    assert [t.name for t in stack.tiers] == ["host", "disk", "redis"]
    assert os.path.isdir(stack.tiers[1].root) and stack.tiers[1].root.parent == tmp_path
    stack.close()
    with pytest.raises(ValueError, match="no KV tier 'nosuchstore' is installed"):
        make_tier("nosuchstore", {}, ctx)
    with pytest.raises(ValueError, match="needs kv_offload_disk_bytes"):
        OffloadConfig(disk_path=str(tmp_path))
    with pytest.raises(ValueError, match="not a URL"):
        OffloadConfig(remote="127.0.0.1:6379")


@pytest.mark.parametrize("arena", ["one_buffer", "per_layer"])
def test_worker_payload_round_trip_through_a_real_arena_layout(tmp_path, arena):
    """Blocks saved (to disk) or evicted (moved into the host) from one arena and loaded
    into another, in one batched job, hold the same bytes; a block loaded from the host
    leaves it (the device holds it now); a missing block stops the load there. Arenas as
    the engine has them (every slot a view of one buffer, `KVArena.page_rows`: a block
    moves in one indexed copy) and as separate per-layer caches (one copy per slot half)."""
    from tokenmill.kv_connector.worker import KVConnectorWorker
    from tokenmill.platforms.kv_messages import BlockTransfer, EvictedBlock, LoadJob

    torch.manual_seed(0)
    host = HostMemoryTier(staging(), 8 * LAYOUT.object_bytes, LAYOUT.object_bytes)
    stack = TierStack([host, DiskTier(tmp_path, 1 << 20)], CODEC)
    if arena == "per_layer":
        caches = [torch.randn(2, 8, 4, 2, 8).to(torch.bfloat16) for _ in range(3)]
        target = [torch.zeros_like(c) for c in caches]
        saver, loader = KVConnectorWorker(stack, LAYOUT), KVConnectorWorker(stack, LAYOUT, staging())
        saver.register_kv_caches(caches)
        loader.register_kv_caches(target)
        assert saver._flat is None
    else:  # 3 slots of 8 blocks of 256-byte pages, [2, 8, 128] each, in one buffer
        rows_layout = KVLayout("tiny", "bfloat16", 4, ((2, 128),) * 3, 1)
        buffers = [torch.randint(0, 256, (3 * 8 * 256,), dtype=torch.uint8), None]
        buffers[1] = torch.zeros_like(buffers[0])
        views = [[b[s * 8 * 256 : (s + 1) * 8 * 256].view(2, 8, 128) for s in range(3)]
                 for b in buffers]
        saver = KVConnectorWorker(stack, rows_layout)
        loader = KVConnectorWorker(stack, rows_layout, staging())
        saver.register_page_rows(views[0])
        loader.register_page_rows(views[1])
        assert saver._flat is not None
        caches, target = views  # per slot [2, 8, 128]: block b is [:, b]
    keys = [obj(i)[0] for i in range(5)]
    saver.save([BlockTransfer(b, k) for b, k in zip((1, 4, 5), keys[:3])])
    assert sorted(saver.drain().saved_keys) == sorted(keys[:3])
    saver.demote([EvictedBlock(6, keys[3], 1.0), EvictedBlock(7, keys[4], 2.0)])
    assert set(host.keys()) == set(keys[3:]) and saver.report().demoted_keys == keys[3:]
    order = [(0, 1, 0), (2, 6, 3), (3, 4, 1), (5, 7, 4), (6, 5, 2)]  # (dst, src, key)
    loader.start_loads([LoadJob("r", [BlockTransfer(d, keys[k]) for d, _, k in order])])
    (result,) = loader.drain().loads
    assert result.num_loaded == 5
    assert result.tiers == ["disk", "host", "disk", "host", "disk"]
    assert set(result.tier_bytes) == {"host", "disk"}
    dst, src = [d for d, _, _ in order], [s for _, s, _ in order]
    for a, b in zip(caches, target):
        assert torch.equal(b[:, dst], a[:, src])
        assert torch.count_nonzero(b[:, [1, 4, 7]]) == 0
    assert host.keys() == []  # moved to the device
    loader.start_loads([LoadJob("s", [BlockTransfer(1, keys[0]), BlockTransfer(2, obj(9)[0])])])
    (result,) = loader.drain().loads
    assert (result.num_loaded, result.num_requested) == (1, 2)
    saver.close()
    loader.close()
    stack.close()


def test_worker_traces_each_job_at_debug(tmp_path, caplog):
    """With DEBUG on, every job of the worker's thread logs how long it waited behind the
    jobs sent before it and how long it ran (what the working-set TTFT profile reads,
    benchmarks/profile_working_set_ttft.py); a load names its request."""
    import logging

    from tokenmill.kv_connector.worker import KVConnectorWorker
    from tokenmill.platforms.kv_messages import BlockTransfer, LoadJob

    host = HostMemoryTier(staging(), 8 * LAYOUT.object_bytes, LAYOUT.object_bytes)
    stack = TierStack([host, DiskTier(tmp_path, 1 << 20)], CODEC)
    caches = [torch.randn(2, 8, 4, 2, 8).to(torch.bfloat16) for _ in range(3)]
    worker = KVConnectorWorker(stack, LAYOUT, staging())
    worker.register_kv_caches(caches)
    keys = [obj(i)[0] for i in range(2)]
    with caplog.at_level(logging.DEBUG, logger="tokenmill.kv_connector.worker"):
        worker.save([BlockTransfer(1, keys[0]), BlockTransfer(2, keys[1])])
        worker.start_loads([LoadJob("req-7", [BlockTransfer(5, keys[0])])])
        assert worker.drain().loads[0].num_loaded == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv job")]
    assert len(lines) == 2, lines
    assert re.fullmatch(r"kv job write 2: waited [0-9.]+ ms ran [0-9.]+ ms", lines[0])
    assert re.fullmatch(r"kv job load req-7: waited [0-9.]+ ms ran [0-9.]+ ms", lines[1])
    caplog.clear()
    worker.start_loads([LoadJob("req-8", [BlockTransfer(6, keys[1])])])  # DEBUG off: silent
    worker.drain()
    assert not [r for r in caplog.records if r.getMessage().startswith("kv job")]
    worker.close()
    stack.close()


def test_engine_args_take_sizes_as_strings_and_name_bad_ones():
    from pydantic import ValidationError

    from tokenmill.engine.config import EngineArgs

    args = EngineArgs(kv_offload_host_bytes="8GiB", kv_offload_disk_path="/tmp/x",
                      kv_offload_disk_bytes="100GiB", kv_offload_remote="redis://127.0.0.1:6379")
    assert (args.kv_offload_host_bytes, args.kv_offload_disk_bytes) == (8 << 30, 100 << 30)
    assert EngineArgs(kv_offload_host_bytes=4096).kv_offload_host_bytes == 4096
    with pytest.raises(ValidationError, match="kv_offload_host_bytes='lots' is not a size"):
        EngineArgs(kv_offload_host_bytes="lots")
    assert EngineArgs(kv_offload_host_bytes="1GiB", distributed_executor_backend="mp")
    with pytest.raises(ValidationError, match="tensor_parallel_size=1 and pipeline_parallel_size=1 for now"):
        EngineArgs(kv_offload_host_bytes="1GiB", tensor_parallel_size=2)
    with pytest.raises(ValidationError, match="needs enable_prefix_caching=True"):
        EngineArgs(kv_offload_host_bytes="1GiB", enable_prefix_caching=False)


def test_a_full_or_vanished_store_degrades_to_the_other_tiers(tmp_path, redis_server):
    import shutil

    size = LAYOUT.object_bytes
    disk = DiskTier(tmp_path / "d", 10 * size)
    remote = RedisTier(redis_server.url)
    stack = TierStack([disk, remote], CODEC)
    # redis at its maxmemory with no eviction refuses writes (an error reply, not an outage)
    admin = redis_server.client()
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", admin.info("memory")["used_memory"] + 1)
    k1, d1 = obj(1)
    assert stack.put(k1, d1) == ["disk"] and stack.stats["redis"].errors == 1
    admin.config_set("maxmemory", 0)
    assert remote.contains(k1) is False and remote.put(*obj(2))  # not marked down for it
    # the disk directory disappears: saves and reads go on with redis
    shutil.rmtree(tmp_path / "d")
    k3, d3 = obj(3)
    assert stack.put(k3, d3) == ["disk", "redis"]  # the tier recreates its directory
    (tmp_path / "d").chmod(0o500)
    k4, d4 = obj(4)
    if os.geteuid() != 0:  # root ignores the permission bits
        assert stack.put(k4, d4) == ["redis"]
    assert stack.get(k1) is None  # its file went with the directory
    assert bytes(stack.get(obj(2)[0])[0]) == obj(2)[1][HEADER_BYTES:]


def test_prompt_logprobs_requests_never_load():
    from tokenmill.engine.request import Request
    from tokenmill.kv_connector.scheduler_side import KVConnectorScheduler
    from tokenmill.sampling_params import SamplingParams

    host = HostMemoryTier(staging(), 64 * LAYOUT.object_bytes, LAYOUT.object_bytes)
    side = KVConnectorScheduler(TierStack([host], CODEC), LAYOUT.fingerprint(), 4)
    prompt = list(range(20))
    plain = Request("a", prompt, SamplingParams())
    scored = Request("b", prompt, SamplingParams(prompt_logprobs=1))
    for r in (plain, scored):
        r.block_hashes = hash_blocks(prompt, 4)
    for h in plain.block_hashes:
        host.put(side.key(h), encode(side.key(h), bytes(LAYOUT.payload_bytes)))
    assert side.num_external_tokens(plain, 0) == 16  # 4 of 5 blocks: the last token computes
    assert side.num_external_tokens(scored, 0) == 0  # every position must be scored


def test_the_cpu_host_tier_may_be_what_the_machine_holds():
    """The CPU plugin's host-staging allocator (the host tier's slab) allows the memory
    available less a reserve, not a fixed share: `--kv-offload-host-bytes 8GiB` starts on
    a 24 GiB machine with that much free (before: 10% of available, ~2 GiB); past what
    the machine holds it refuses with the figures."""
    import psutil

    from tokenmill.platforms.interfaces import OutOfMemoryError
    from tokenmill_cpu.allocator import HOST_RESERVE_MAX, make_allocator

    memory = psutil.virtual_memory()
    alloc = make_allocator(AllocatorPurpose.HOST_STAGING)
    reserve = min(HOST_RESERVE_MAX, memory.total // 10)
    assert abs(alloc.bytes_limit() - (memory.available - reserve)) < (256 << 20)
    assert alloc.bytes_limit() > 0.5 * memory.available  # the tier the operator asked for
    with pytest.raises(OutOfMemoryError, match=r"GiB available less a .* GiB reserve"):
        alloc.allocate(memory.total)
