"""The objects a platform plugin hands to the core, and the types they speak.

Everything that crosses the plugin seam is declared here: the `Platform` a plugin
activates, its frozen `Capabilities`, the attention backend interface, the communicator,
the allocators and the hardware spec; with the per-layer state types of
`layer_state.py` and the model-runner and graph-capture seam of `model_runner.py`, both
re-exported here. The core only ever talks to these interfaces; it
never imports a vendor library.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.platforms.layer_state import (  # noqa: F401 - part of the seam
    STATE_ALIGN,
    MLADims,
    RecurrentStateMetadata,
    RecurrentStateSpec,
    StateTensorSpec,
)
from tokenmill.platforms.model_runner import (  # noqa: F401 - part of the seam
    GraphCapture,
    KVCacheLayout,
    KVCachePages,
    KVCacheSpec,
    ModelRunnerBase,
    ModelRunnerContext,
    ParallelConfig,
    RunnerCapabilities,
)
from tokenmill.platforms.versions import PLUGIN_API_VERSION  # noqa: F401 - part of the seam

# the version history: tokenmill.platforms.versions and docs/contract-changelog.md


class AttentionKind(str, enum.Enum):
    """The attention families a backend can implement."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    LINEAR = "linear"  # recurrent / state-space layers (Gated DeltaNet, Mamba, ...)
    MLA = "mla"


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What one attention layer needs from a backend.

    A LINEAR layer (recurrent: Gated DeltaNet, Mamba2, KDA) sets `state` and uses
    num_heads / num_kv_heads / head_size for its value heads, key heads and key head size
    (informative only: the state's shapes are in `state`).

    For `AttentionKind.MLA`, `mla` holds the layer's dimensions; `num_kv_heads` is 1 and
    `head_size` is `mla.latent_size` (what the cache holds per token), and `scale` is set
    (the model's softmax scale over the qk_head_dim-wide dot products).
    """

    kind: AttentionKind  # which family of backend runs the layer
    num_heads: int  # query heads (a LINEAR layer: value heads)
    num_kv_heads: int  # key/value heads (GQA groups); 1 for MLA; LINEAR: key heads
    head_size: int  # per head; MLA: what a cached token holds (kv_lora_rank + rope)
    dtype: torch.dtype  # of the queries, and of the cache unless `cache_dtype` is set
    block_size: int  # tokens per KV block (page)
    sliding_window: int | None = None  # tokens a query sees back (SLIDING_WINDOW); None: all
    scale: float | None = None  # None means head_size ** -0.5
    # Learned per-head sink logits (gpt-oss): each query's softmax has one extra logit per
    # head that takes probability mass and contributes no value. The layer then calls
    # `forward(..., sinks=...)` with a float32 [num_heads] tensor, only on a backend that
    # sets `AttentionBackend.supports_sinks` (the core otherwise runs that layer on its
    # reference attention and logs it).
    sinks: bool = False
    # kind LINEAR only: the per-sequence state the layer keeps (None for attention kinds)
    state: RecurrentStateSpec | None = None
    mla: MLADims | None = None  # exactly for AttentionKind.MLA
    # The dtype the paged cache stores when it is not `dtype`: a quantized KV cache
    # (torch.float8_e4m3fn or torch.float8_e5m2, EngineArgs.kv_cache_dtype). Keys and
    # values are written as round(x / scale) and read as stored * scale, with the float32
    # scales [num_kv_heads] (MLA: [1], the latent row's) that the layer passes `forward`
    # as the keywords `k_scale` and `v_scale`; only a backend whose `kv_cache_dtypes`
    # holds it gets such a spec. Never set on LINEAR layers (states keep their dtypes).
    cache_dtype: torch.dtype | None = None

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the paged cache holds: `cache_dtype`, else `dtype`."""
        return self.cache_dtype if self.cache_dtype is not None else self.dtype

    def __post_init__(self) -> None:
        if self.cache_dtype is not None and self.kind == AttentionKind.LINEAR:
            raise ValueError(
                f"a LINEAR spec with cache_dtype={self.cache_dtype}: recurrent state keeps "
                "the dtypes of its RecurrentStateSpec; only attention KV is quantized"
            )
        if (self.kind == AttentionKind.LINEAR) != (self.state is not None):
            raise ValueError(
                f"an AttentionSpec of kind {self.kind.value!r} with state={self.state}: a "
                "LINEAR layer declares its state (RecurrentStateSpec), other kinds do not"
            )
        if (self.kind == AttentionKind.MLA) != (self.mla is not None):
            raise ValueError(f"attention kind {self.kind.value!r} with mla={self.mla}: MLA "
                             "layers, and only they, carry MLADims")
        if self.mla is not None and (
            self.num_kv_heads != 1 or self.head_size != self.mla.latent_size
        ):
            raise ValueError(
                f"an MLA spec caches one latent row per token: num_kv_heads must be 1 (got "
                f"{self.num_kv_heads}) and head_size kv_lora_rank + qk_rope_head_dim = "
                f"{self.mla.latent_size} (got {self.head_size})"
            )


def kv_cache_shape(spec: AttentionSpec, num_blocks: int) -> tuple[int, ...]:
    """The standard layout of one layer's paged cache of `num_blocks` blocks.

    FULL and SLIDING_WINDOW: [2, num_blocks, block_size, num_kv_heads, head_size] (keys,
    then values). MLA: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (each
    token's latent row: c_kv then k_pe), about (2 * heads * head) / latent times smaller
    than the equivalent multi-head cache. A backend that wants another view of the same
    bytes says so in `AttentionBackend.kv_cache_shape`. LINEAR layers keep states, not
    per-token pages (`RecurrentStateSpec`).
    """
    if spec.kind == AttentionKind.MLA:
        return (num_blocks, spec.block_size, spec.head_size)
    if spec.kind in (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW):
        return (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    raise ValueError(f"attention kind {spec.kind.value!r} keeps no paged KV cache")


@dataclass(slots=True)
class AttentionMetadata:
    """The shape of one engine step, as the attention backends see it.

    Tokens of all scheduled sequences are flattened into one ragged batch, sequence by
    sequence. A sequence's new tokens are the last `query_len` tokens of its context.
    Built once per step by the model runner; shared by every layer.
    """

    num_tokens: int  # total new tokens in the step
    num_seqs: int  # sequences in the step (each with at least one new token)
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], device: cumulative query lengths
    seq_lens: torch.Tensor  # int32 [num_seqs], device: context length incl. this step's tokens
    block_tables: torch.Tensor  # int32 [num_seqs, max_num_blocks], device; padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens], device: block_id * block_size + offset
    query_lens_cpu: list[int]  # host copy of the per-sequence query lengths
    seq_lens_cpu: list[int]  # host copy of seq_lens
    max_query_len: int  # the longest query_lens_cpu entry
    max_seq_len: int  # the longest seq_lens_cpu entry
    block_size: int  # tokens per KV block (page)
    # Backends may stash per-step precomputed state here (keyed by backend name) in
    # `AttentionBackend.prepare`; the core never reads it.
    backend_state: dict[str, object] = field(default_factory=dict)
    # a KV group of LINEAR layers: where its sequences' states are (None for attention;
    # block_tables then hold the state slots and slot_mapping is empty)
    recurrent: RecurrentStateMetadata | None = None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_ids: list[list[int]],
        block_size: int,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """Metadata for sequences whose i-th computes its last `query_lens[i]` tokens of
        `seq_lens[i]`, with block table `block_ids[i]` (which must cover seq_lens[i])."""
        num_seqs = len(query_lens)
        tables = torch.zeros((num_seqs, max(len(b) for b in block_ids)), dtype=torch.int32)
        for i, ids in enumerate(block_ids):
            tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        seq_index, positions = token_positions(query_lens, seq_lens)
        slots = tables[seq_index, positions // block_size].long() * block_size
        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
        return cls(
            num_tokens=len(positions),
            num_seqs=num_seqs,
            query_start_loc=query_start_loc.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            slot_mapping=(slots + positions % block_size).to(device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
        )


def recurrent_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    recurrent: RecurrentStateMetadata,
    block_size: int,
    device: torch.device | str | None = None,
) -> AttentionMetadata:
    """Metadata for a KV group of LINEAR layers: the step's shape as `AttentionMetadata.build`
    gives it, block tables = the state slots, no slot mapping (states are not per token)."""
    slots = [list(ids) or [0] for ids in recurrent.state_block_ids]
    tables = torch.zeros((len(slots), max(len(ids) for ids in slots)), dtype=torch.int32)
    for i, ids in enumerate(slots):
        tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    return AttentionMetadata(
        num_tokens=sum(query_lens),
        num_seqs=len(query_lens),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        recurrent=recurrent,
    )


def token_positions(
    query_lens: list[int], seq_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a flattened ragged batch: each token's sequence index and its position in that
    sequence (sequence i's tokens are the last query_lens[i] of seq_lens[i]). int64 [T] each."""
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    seq_index = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
    first = q_lens.cumsum(0) - q_lens
    starts = torch.tensor(seq_lens, dtype=torch.int64) - q_lens
    positions = torch.arange(int(q_lens.sum())) - first[seq_index] + starts[seq_index]
    return seq_index, positions


class AttentionBackend(ABC):
    """Paged attention for one attention kind.

    A backend is stateless across steps. `prepare` is called once per step with the step's
    metadata before any layer runs; `forward` is called once per layer.
    """

    name: str = "abstract"
    kind: AttentionKind = AttentionKind.FULL
    # whether `forward` takes `sinks` (AttentionSpec.sinks); plugins written before 1.2
    # do not, and never get a spec with sinks
    supports_sinks: bool = False
    # the quantized cache dtypes (AttentionSpec.cache_dtype) `forward` stores and reads,
    # with the `k_scale` / `v_scale` keywords; a backend without any never gets such a spec
    kv_cache_dtypes: frozenset[torch.dtype] = frozenset()

    @abstractmethod
    def supports(self, spec: AttentionSpec) -> bool:
        """Whether this backend can run a layer with this spec (dtype, head size, ...)."""

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Precompute per-step state (gather indices, masks) into `metadata.backend_state`."""

    def kv_cache_shape(self, spec: AttentionSpec, num_blocks: int) -> tuple[int, ...]:
        """The shape the arena views one layer's pages as (`kv_cache` in `forward`); the
        core's standard layout (`kv_cache_shape`) unless overridden. Must not depend on
        anything but `spec` and `num_blocks`, and must hold exactly the standard layout's
        bytes (the arena checks)."""
        return kv_cache_shape(spec, num_blocks)

    @abstractmethod
    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write key/value into `kv_cache` at `metadata.slot_mapping`, then attend.

        Each query token attends causally to its sequence's context (cached tokens plus the
        step's tokens up to and including itself). Returns [num_tokens, num_heads, head_size].
        With `spec.sinks` the core adds the keyword `sinks` (float32 [num_heads]); only a
        backend with `supports_sinks` gets such a spec. With `spec.cache_dtype` (a
        quantized cache, one of `kv_cache_dtypes`) it adds `k_scale` and `v_scale`
        (float32 [num_kv_heads]): write `(x / scale)` saturated to the cache dtype, read
        `stored * scale` (`tokenmill.platforms.ops.kv_quant`, the reference).

        MLA (`spec.kind == AttentionKind.MLA`, see `MLADims`; reference:
        `tokenmill.platforms.ops.mla.mla_attention`) reads the arguments as: `query` [num_tokens,
        num_heads, qk_nope_head_dim + qk_rope_head_dim] (q_nope | roped q_pe); `key`
        [num_tokens, 1, kv_lora_rank + qk_rope_head_dim], the latent row to cache (c_kv |
        roped k_pe); `value` None; `kv_cache` [num_blocks, block_size, kv_lora_rank +
        qk_rope_head_dim]; and the keywords `w_uk` [num_heads, qk_nope_head_dim,
        kv_lora_rank] and `w_uv` [num_heads, v_head_dim, kv_lora_rank]; a quantized latent
        cache uses `k_scale` ([1]) for the whole row (`v_scale` is passed and unused). Returns
        [num_tokens, num_heads, v_head_dim]. A backend may decompress the latents (prefill)
        or fold `w_uk` into the query and apply `w_uv` after (decode); both are exact.
        """


class LinearAttentionBackend(AttentionBackend):
    """Recurrent layers (kind LINEAR): a chunked scan for prefill, the recurrence for
    decode, over per-sequence states that live in the KV arena.

    Dispatches on `spec.state.variant`: `variants` lists those it runs. Each variant's
    inputs are a dataclass defined beside its pure-PyTorch reference in
    `tokenmill.platforms.ops.linear_attention` (`REFERENCE_VARIANTS`), e.g. `GatedDeltaInputs`;
    the model layer builds them (projections stay in the model) and gets the layer's
    output back. `forward` replaces the attention signature for this kind; `prepare` is
    as for attention.
    """

    kind: AttentionKind = AttentionKind.LINEAR
    variants: frozenset[str] = frozenset()

    def supports(self, spec: AttentionSpec) -> bool:
        """A LINEAR spec whose state variant is one of `variants`."""
        return spec.kind == AttentionKind.LINEAR and spec.state.variant in self.variants

    @abstractmethod
    def forward(  # type: ignore[override]
        self,
        spec: AttentionSpec,
        inputs: Any,  # the variant's inputs dataclass, tokens flattened as in metadata
        state_cache: torch.Tensor,  # uint8 [2, num_blocks, page_bytes // 2]: the layer's pages
        metadata: AttentionMetadata,  # with `recurrent` set
    ) -> torch.Tensor:
        """Run the layer's recurrence over the step's tokens, sequence by sequence.

        For sequence i: start from the state in `recurrent.source_block_ids[i]` (zeros when
        None), process its query tokens, write the states `recurrent.checkpoints[i]` asks
        for, and leave the final state in `recurrent.state_block_ids[i]`. Never writes a
        source that is not the sequence's own slot. Returns the variant's output
        ([num_tokens, ...], see the variant's reference).
        """


class Communicator(ABC):
    """Collectives over one process group. Tensors are reduced in place where noted."""

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; returns the reduced tensor (may be the input, reduced in place)."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's tensor along `dim`, in rank order."""

    @abstractmethod
    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then return this rank's slice of `dim` (size divisible by world)."""

    @abstractmethod
    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Split dim 0 into world_size chunks; chunk i goes to rank i; concatenate received."""

    def all_to_all_single(
        self, tensor: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int]
    ) -> torch.Tensor:
        """Uneven all-to-all along dim 0: the first `input_split_sizes[0]` rows go to rank 0,
        the next `input_split_sizes[1]` to rank 1, ...; returns the rows received, rank by
        rank, `output_split_sizes[i]` of them from rank i (torch's `all_to_all_single`).
        Every rank's `output_split_sizes[i]` must equal rank i's `input_split_sizes` entry
        for it (expert parallel exchanges the counts with `all_to_all` first).

        This default composes `all_gather` (of the split sizes, to agree on the largest
        chunk) and `all_to_all` (chunks zero-padded to it); a platform with a native uneven
        all-to-all overrides it. Does not modify `tensor`.
        """
        world = self.world_size
        if len(input_split_sizes) != world or len(output_split_sizes) != world:
            raise ValueError(
                f"all_to_all_single: {len(input_split_sizes)} input and "
                f"{len(output_split_sizes)} output split sizes for a world of {world}"
            )
        if sum(input_split_sizes) != tensor.shape[0]:
            raise ValueError(
                f"all_to_all_single: input split sizes {input_split_sizes} do not add up to "
                f"the {tensor.shape[0]} rows given"
            )
        sizes = torch.tensor(input_split_sizes, dtype=torch.int64, device=tensor.device)
        chunk = int(self.all_gather(sizes).max().item()) if world > 1 else tensor.shape[0]
        padded = tensor.new_zeros((world * chunk, *tensor.shape[1:]))
        start = 0
        for rank, size in enumerate(input_split_sizes):
            padded[rank * chunk : rank * chunk + size] = tensor[start : start + size]
            start += size
        received = self.all_to_all(padded)
        return torch.cat([
            received[rank * chunk : rank * chunk + size]
            for rank, size in enumerate(output_split_sizes)
        ])

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` to rank `dst` of the group (blocking; pipeline stages)."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into `tensor` (shape and dtype must match the sender's); returns it."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s tensor on every rank (in place into `tensor`); returns it."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank of the group has called it."""


class AllocatorPurpose(str, enum.Enum):
    """Which memory an allocator hands out: the KV arena, model weights, or host
    staging buffers (KV offload's copies, host tiers)."""

    KV_ARENA = "kv_arena"
    WEIGHTS = "weights"
    HOST_STAGING = "host_staging"


class OutOfMemoryError(RuntimeError):
    """An allocator could not satisfy a request. Says how much was asked and what was free."""


class Allocator(ABC):
    """Hands out device memory for one purpose."""

    purpose: AllocatorPurpose

    @abstractmethod
    def allocate(self, num_bytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly `num_bytes` bytes on the platform's device.

        Raises `OutOfMemoryError` (never returns a smaller buffer) if it cannot.
        """

    @abstractmethod
    def free(self, buffer: torch.Tensor) -> None:
        """Give back a buffer returned by `allocate`. Freeing twice is an error."""

    @abstractmethod
    def bytes_in_use(self) -> int:
        """Bytes handed out and not yet freed (exact: conformance T1 checks)."""

    @abstractmethod
    def bytes_limit(self) -> int:
        """The most this allocator will hand out in total."""

    def sleep(self, keep_contents: bool) -> int:
        """Sleep mode (called only on platforms that declare `capabilities.sleep_mode`,
        by `LLM.sleep`): free the memory of every live buffer while the buffer tensors and
        their views stay valid objects; with `keep_contents` their bytes are kept in host
        memory for `wake`. Returns the bytes freed. Sleeping twice is an error;
        `allocate` while asleep is an error. `tokenmill.platforms.sleep.BufferSleep`
        implements the mechanics."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    def wake(self) -> None:
        """Give every buffer its memory back (same tensors and views, possibly new
        addresses): kept contents restored, the others zeroed. Waking an awake allocator
        is an error."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """What the hardware can do at best, for the planner and the roofline report."""

    name: str
    peak_flops: Mapping[str, float]  # dtype name ("bfloat16", "float32") -> FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    link_bandwidth: float = 0.0  # bytes/s between devices; 0 for a single device


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """One kernel in one launch configuration compiled ahead of time for one real target
    (a GPU or TPU the plugin ships settings for), without the device: what the conformance
    suite certifies for devices it cannot run on.

    `registers`: per thread (NVIDIA) or VGPRs per lane (AMD), None where the target has no
    such figure; `spill_bytes`: register spills to local memory (loads and stores), 0 when
    none; `shared_bytes`: shared memory / LDS / VMEM scratch per program; `error`: the
    compiler's message when it failed, else None; `note`: anything the record must say
    (e.g. "lowered only: libtpu does not install here")."""

    target: str  # "sm_90", "gfx942", "tpu v5e"
    kernel: str
    config: str  # the launch configuration, readable (tiles, warps, constexprs)
    case: str  # the launch it comes from (op and shape)
    registers: int | None
    spill_bytes: int | None
    shared_bytes: int | None
    seconds: float
    error: str | None = None
    note: str = ""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a platform declares it supports; the core and the conformance suite branch on it."""

    # the kinds its attention backends serve (one backend per kind at least)
    attention_kinds: frozenset[AttentionKind] = frozenset({AttentionKind.FULL})
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32})  # compute and cache dtypes
    block_sizes: frozenset[int] = frozenset({16})  # KV block sizes (tokens) it supports
    head_sizes: frozenset[int] = frozenset({64, 128})  # attention head sizes it supports
    collectives: bool = False  # implements tokenmill_communicator (tp, pp, ep, cp)
    graphs: bool = False  # tokenmill_graph_capture may return decode-step graphs
    sleep_mode: bool = False  # its allocators implement sleep / wake (LLM.sleep)
    # quantized KV cache dtypes (EngineArgs.kv_cache_dtype: torch.float8_e4m3fn,
    # torch.float8_e5m2) its backends of every declared attention kind but LINEAR store
    # (AttentionBackend.kv_cache_dtypes); empty: the cache is in the compute dtype only
    kv_cache_dtypes: frozenset[torch.dtype] = frozenset()
    # runs a checkpoint's quantized layers as they are (`prepack_quantized_linear`, or its
    # own model runner's); False: the core refuses a quantized `--quantization` and
    # dequantizes a quantized checkpoint left unset (1.9)
    quantized_weights: bool = True


@dataclass(frozen=True, slots=True)
class Platform:
    """An activated platform: the device the engine runs on and what it can do."""

    name: str  # the platform's name (its entry point's, what --platform takes)
    device_type: str  # torch device type string, e.g. "cpu"
    capabilities: Capabilities  # what it supports; frozen
    default_dtype: torch.dtype  # EngineArgs.dtype "auto" resolves to it
    memory_info: Callable[[], MemoryInfo]  # total and free device memory, now
    version: str = "0"  # the device software's version, for the certificate
    # The most prompt tokens one request computes per step when EngineArgs leaves
    # long_prefill_token_threshold unset (None: no limit but the step's budget). A request
    # arriving while a long prompt is prefilled waits for the step in flight: a slow device
    # wants a long prompt cut into short steps to keep time to first token low; a fast one
    # can take the whole budget at once.
    long_prefill_token_threshold: int | None = None

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)


@dataclass(frozen=True, slots=True)
class DetectionResult:
    """The answer of a plugin's cheap availability probe."""

    available: bool
    reason: str = ""


# Op names a plugin may override through `tokenmill_ops`; each has a reference in
# `tokenmill.platforms.ops.reference` with the same signature.
OP_NAMES = frozenset(
    {
        "rms_norm",
        "fused_add_rms_norm",
        "rotary_embedding",
        "silu_and_mul",
        "prepack_linear",
        "copy_blocks",  # KV blocks within each layer's cache (conformance tier T2)
        "swap_blocks",  # KV blocks between two caches, e.g. device <-> host (tier T2)
        "apply_token_bitmask",  # structured output's grammar mask on the logits (tier T1)
        "gelu_tanh_and_mul",  # Gemma's gated MLP activation
        "moe_experts",  # routed expert GEMMs of a mixture-of-experts layer (tier T1)
        # a quantized weight's matmul (ops/quant.py: GGUF, AWQ, GPTQ, FP8; tier T1)
        "prepack_quantized_linear",
    }
)
