"""Plugins with planted kernel bugs that a vendor could ship: tier T1 must refuse each in
bfloat16, naming the op. Each declares only bfloat16 (whose elementwise tolerance is 2e-2),
full and sliding-window attention and Gated DeltaNet; the kernels are plain torch, each
right but for one bug:

- `scale`: attention outputs scaled by 1.01 (inside rtol 2e-2 everywhere: only the error
  statistics see it);
- `off_by_one_block`: the number of a sequence's KV blocks rounded down, so the keys of a
  last partial block are never read;
- `wrong_window`: a sliding window one key too wide ((p - w - 1, p] instead of (p - w, p]);
- `wrong_gqa`: query head h reads KV head h % num_kv_heads instead of h // group;
- `dropped_chunk_state`: the Gated DeltaNet scan drops the carried state at every
  64-token chunk boundary, restarting from the step's initial state.

Registered in-process: `tokenmill-conformance --platform planted --plugin
tests/conformance/planted_plugin.py:scale` (or another bug's name).
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
    DetectionResult,
    HardwareSpec,
    MemoryInfo,
    Platform,
)
from tokenmill.platforms.kit.host_allocator import HostAllocator
from tokenmill.platforms.kit.kv_state import write_states
from tokenmill.platforms.ops.linear_attention import ReferenceLinearAttentionBackend, initial_state
from tokenmill.platforms.ops.reference import write_kv

hookimpl = pluggy.HookimplMarker("tokenmill")
BUGS = ("scale", "off_by_one_block", "wrong_window", "wrong_gqa", "dropped_chunk_state")
CHUNK = 64
_LIMIT = 8 << 30
CAPABILITIES = Capabilities(
    attention_kinds=frozenset({AttentionKind.FULL, AttentionKind.SLIDING_WINDOW,
                               AttentionKind.LINEAR}),
    dtypes=frozenset({torch.bfloat16}),
    block_sizes=frozenset({16}),
    head_sizes=frozenset({64, 128, 256}),
)


class PlantedAttention(AttentionBackend):
    """Paged attention in torch, one sequence at a time, float32 math, with `bug`."""

    def __init__(self, kind: AttentionKind, bug: str) -> None:
        self.kind = kind
        self.bug = bug
        self.name = f"planted_{bug}_{kind.value}"

    def supports(self, spec: AttentionSpec) -> bool:
        return spec.kind == self.kind and not spec.sinks

    def forward(self, spec: AttentionSpec, query, key, value, kv_cache,
                metadata: AttentionMetadata) -> torch.Tensor:
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        scale = spec.scale if spec.scale is not None else spec.head_size**-0.5
        group = spec.num_heads // spec.num_kv_heads
        heads = torch.arange(spec.num_heads)
        kv_of_head = heads % spec.num_kv_heads if self.bug == "wrong_gqa" else heads // group
        block = kv_cache.shape[2]
        out = torch.empty_like(query)
        starts = metadata.query_start_loc.tolist()
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            blocks = seq_len // block if self.bug == "off_by_one_block" else -(-seq_len // block)
            ids = metadata.block_tables[i, :blocks].long()
            keys = min(seq_len, blocks * block)
            k = kv_cache[0, ids].flatten(0, 1)[:keys, kv_of_head].float()  # [keys, H, D]
            v = kv_cache[1, ids].flatten(0, 1)[:keys, kv_of_head].float()
            q = query[starts[i]:starts[i + 1]].float()
            q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
            k_pos = torch.arange(keys)[None, :]
            visible = k_pos <= q_pos
            if spec.sliding_window is not None:
                width = spec.sliding_window + (self.bug == "wrong_window")
                visible &= k_pos > q_pos - width
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
            result = torch.einsum("hqk,khd->qhd", probs, v)
            if self.bug == "scale":
                result = result * 1.01
            out[starts[i]:starts[i + 1]] = result.to(out.dtype)
        return out


class DroppedChunkState(ReferenceLinearAttentionBackend):
    """The reference's scan, except that at every CHUNK-token boundary of a sequence the
    state carried from the previous chunk is dropped: the next chunk starts from the state
    the step began with (a kernel that reloads its input state per chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "planted_dropped_chunk_state_linear"

    def forward_sequence(self, spec, inputs, state_cache, metadata, i, lo, hi):
        variant = self._impls[spec.state.variant]
        rec = metadata.recurrent
        start = initial_state(state_cache, spec.state, rec.source_block_ids[i])
        marks = {lo + n: pages for n, pages in rec.checkpoints[i]}
        cuts = sorted(set(marks) | set(range(lo + CHUNK, hi, CHUNK)) | {hi})
        state, at, outs = start, lo, []
        for cut in cuts:
            if cut > at:
                out, state = variant.run(spec, inputs, at, cut, state)
                outs.append(out)
                at = cut
            if cut in marks:
                write_states(state_cache, spec.state, [marks[cut]], [t[None] for t in state])
            if (cut - lo) % CHUNK == 0:
                state = start  # BUG: the chunk's final state is not carried on
        write_states(state_cache, spec.state, [rec.state_block_ids[i]], [t[None] for t in state])
        return torch.cat(outs)


class PlantedPlugin:
    """A whole plugin with one planted bug (module docstring)."""

    def __init__(self, bug: str) -> None:
        if bug not in BUGS:
            raise ValueError(f"unknown bug {bug!r}; one of {BUGS}")
        self.bug = bug

    @hookimpl
    def tokenmill_api_version(self) -> str:
        return "1.3"  # LINEAR (1.3)

    @hookimpl
    def tokenmill_detect(self) -> DetectionResult:
        return DetectionResult(True, f"planted bug {self.bug!r} (a conformance test plugin)")

    @hookimpl
    def tokenmill_platform(self) -> Platform:
        limit = MemoryInfo(total_bytes=_LIMIT, free_bytes=_LIMIT)
        return Platform(name=f"planted-{self.bug}", device_type="cpu", capabilities=CAPABILITIES,
                        default_dtype=torch.bfloat16, memory_info=lambda: limit)

    @hookimpl
    def tokenmill_attention_backends(self, platform: Platform) -> list[AttentionBackend]:
        paged = [PlantedAttention(k, self.bug)
                 for k in (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW)]
        linear = DroppedChunkState() if self.bug == "dropped_chunk_state" else (
            ReferenceLinearAttentionBackend())
        return [*paged, linear]

    @hookimpl
    def tokenmill_allocator(self, platform: Platform, purpose: AllocatorPurpose) -> Allocator:
        return HostAllocator(purpose, _LIMIT, "the planted platform's fixed limit", owner="planted")

    @hookimpl
    def tokenmill_hardware_spec(self, platform: Platform) -> HardwareSpec:
        return HardwareSpec(name="planted (nominal)", peak_flops={"bfloat16": 1e11},
                            memory_bandwidth=1e10, memory_bytes=_LIMIT)


scale = PlantedPlugin("scale")
off_by_one_block = PlantedPlugin("off_by_one_block")
wrong_window = PlantedPlugin("wrong_window")
wrong_gqa = PlantedPlugin("wrong_gqa")
dropped_chunk_state = PlantedPlugin("dropped_chunk_state")
