"""A deliberately broken platform plugin: the conformance suite must refuse it.

Registered in-process (`tokenmill-conformance --platform broken --plugin <this file>`).
Its contract is valid, so T0 passes; two classic bugs make T1 fail:
- attention ignores the keys of a sequence's last partial block (all but the query's own);
- all_reduce drops the last rank's contribution.
"""

from __future__ import annotations

import pluggy
import torch

from tokenmill.platforms.interfaces import (
    Allocator,
    AllocatorPurpose,
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
    Capabilities,
    Communicator,
    DetectionResult,
    HardwareSpec,
    MemoryInfo,
    Platform,
)
from tokenmill.platforms.kit.host_allocator import HostAllocator
from tokenmill.platforms.ops.reference import gather_kv, write_kv

hookimpl = pluggy.HookimplMarker("tokenmill")


class LastPartialBlockBug(AttentionBackend):
    """The reference's math, but keys past the last full block are skipped (except the
    query's own position), as a kernel that loops over whole blocks only would do."""

    name = "broken_full"
    kind = AttentionKind.FULL

    def supports(self, spec: AttentionSpec) -> bool:
        return spec.kind is AttentionKind.FULL and spec.num_heads % spec.num_kv_heads == 0

    def forward(self, spec, query, key, value, kv_cache, metadata: AttentionMetadata):
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        scale = spec.scale if spec.scale is not None else spec.head_size**-0.5
        group = spec.num_heads // spec.num_kv_heads
        out = torch.empty_like(query)
        starts = metadata.query_start_loc.tolist()
        for i in range(metadata.num_seqs):
            q = query[starts[i] : starts[i + 1]].float()
            seq_len = metadata.seq_lens_cpu[i]
            k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len)
            k = k.float().repeat_interleave(group, dim=1)
            v = v.float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            q_pos = torch.arange(seq_len - q.shape[0], seq_len).unsqueeze(1)
            k_pos = torch.arange(seq_len).unsqueeze(0)
            full_blocks_end = seq_len // spec.block_size * spec.block_size
            visible = (k_pos <= q_pos) & ((k_pos < full_blocks_end) | (k_pos == q_pos))
            probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
            out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
        return out


class DropsLastRank(Communicator):
    """Correct collectives, except all_reduce, which forgets the last rank."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        gathered = self.inner.all_gather(tensor.contiguous().unsqueeze(0))
        return gathered[: max(1, self.world_size - 1)].sum(dim=0).to(tensor.dtype)

    def all_gather(self, tensor, dim=0):
        return self.inner.all_gather(tensor, dim)

    def reduce_scatter(self, tensor, dim=0):
        return self.inner.reduce_scatter(tensor, dim)

    def all_to_all(self, tensor):
        return self.inner.all_to_all(tensor)

    def send(self, tensor, dst):
        self.inner.send(tensor, dst)

    def recv(self, tensor, src):
        return self.inner.recv(tensor, src)

    def broadcast(self, tensor, src=0):
        return self.inner.broadcast(tensor, src)

    def barrier(self):
        self.inner.barrier()


@hookimpl
def tokenmill_api_version() -> str:
    return "1.0"


@hookimpl
def tokenmill_detect() -> DetectionResult:
    return DetectionResult(True, "always (a test plugin)")


@hookimpl
def tokenmill_platform() -> Platform:
    return Platform(
        name="broken",
        device_type="cpu",
        capabilities=Capabilities(
            attention_kinds=frozenset({AttentionKind.FULL}),
            dtypes=frozenset({torch.float32}),
            block_sizes=frozenset({4, 16}),
            head_sizes=frozenset({32, 64}),
            collectives=True,
        ),
        default_dtype=torch.float32,
        memory_info=lambda: MemoryInfo(1 << 30, 1 << 30),
    )


@hookimpl
def tokenmill_attention_backends(platform: Platform) -> list[AttentionBackend]:
    return [LastPartialBlockBug()]


@hookimpl
def tokenmill_communicator(platform: Platform, group: object | None) -> Communicator:
    from tokenmill_cpu.communicator import make_communicator

    return DropsLastRank(make_communicator(group))


@hookimpl
def tokenmill_allocator(platform: Platform, purpose: AllocatorPurpose) -> Allocator:
    return HostAllocator(purpose, 1 << 30, "1 GiB", owner="broken")


@hookimpl
def tokenmill_hardware_spec(platform: Platform) -> HardwareSpec:
    return HardwareSpec("broken test device", {"float32": 1e11}, 1e10, 1 << 30)
