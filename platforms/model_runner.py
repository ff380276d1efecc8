"""The seam for whole model runners and decode-step graphs.

Every runner, the core's and a plugin's, comes through `tokenmill_model_runner` and is
treated alike: it gets a `ModelRunnerContext` (config, weights, KV spec with the core's
KV-group plan, `ParallelConfig`), declares a frozen `RunnerCapabilities` (checked once at
start against the model and the engine's settings), says which pages its layers need
(`KVCacheLayout`), and runs over page views of the worker's KV arena (`KVCachePages`):
the worker owns the arena, so KV offload, sleep mode and sizing work the same for every
runner. Also what `tokenmill_graph_capture` returns (`GraphCapture`).
`tokenmill.platforms.interfaces` re-exports every name here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.platforms.step import StepDescription, StepResult

if TYPE_CHECKING:
    from tokenmill.platforms.interfaces import AttentionBackend, AttentionKind, AttentionSpec


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The model's KV cache as the core plans it: one page per layer per block id."""

    attention_specs: tuple[AttentionSpec, ...]  # one per layer, in layer order
    block_size: int  # tokens per block
    # fixed by the user (EngineArgs.num_kv_blocks); None: the worker sizes the pool after
    # `ModelRunnerBase.profile`, from the platform's memory_info
    num_blocks: int | None = None
    num_bytes: int | None = None  # EngineArgs.kv_cache_memory_bytes; None: from memory_info
    # per layer: its KV group, i.e. which block table of the step it reads (group 0:
    # `NewRequest.block_ids`, group g >= 1: `extra_block_ids[g - 1]`); layers of one
    # attention type share a group (a hybrid model has several)
    layer_groups: tuple[int, ...] = ()
    # per layer: its arena slot (the layers of one group sit in distinct slots; groups of
    # other types reuse the slots, so their blocks come from one free list)
    layer_slots: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RunnerCapabilities:
    """What a model runner can do, declared once (frozen) and checked once at start.

    The worker refuses to start when the model has a layer kind outside
    `attention_kinds`, or when the engine asks for KV offload and `kv_offload` is False;
    a sleep request is refused unless `sleep_mode`; `graphs` says the runner captures
    decode-step graphs (the platform's `GraphCapture`) where the platform offers them.
    """

    attention_kinds: frozenset[AttentionKind]  # the layer kinds it runs
    # the runner's KV lives in the worker's pages between steps (`bind_kv_cache`), so the
    # KV tiers may copy blocks out of and into them while it runs
    kv_offload: bool = False
    sleep_mode: bool = False  # implements `sleep` / `wake_up`
    graphs: bool = False  # captures decode-step graphs where the platform offers them
    # verifies speculative drafts (`StepDescription.spec_token_ids`); False: the engine
    # sends none
    speculative: bool = False


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """The pages a runner's layers need from the worker's arena."""

    attention_specs: tuple[AttentionSpec, ...]  # one per layer it caches, in layer order
    # per layer: its arena slot; None: `KVCacheSpec.layer_slots` (the core's plan)
    layer_slots: tuple[int, ...] | None = None
    # per layer: the backend whose `kv_cache_shape` views its pages; None: the standard
    # layout (`interfaces.kv_cache_shape`; uint8 [2, num_blocks, page_bytes // 2] for a
    # LINEAR layer's state pages, read with `tokenmill.platforms.kit.kv_state`)
    backends: tuple[AttentionBackend | None, ...] | None = None
    # block ids past the scheduler's the runner keeps for itself (a graph's padding rows
    # write a scratch block): ids num_blocks .. num_blocks + reserved_blocks - 1
    reserved_blocks: int = 0


@dataclass(frozen=True, slots=True)
class KVCachePages:
    """Views of the worker's KV arena, handed to `ModelRunnerBase.bind_kv_cache`.

    Writing a view writes the arena: that is where a runner keeps its KV. The worker
    frees the arena at shutdown and may copy blocks of it to and from the KV tiers
    between steps (runners that declare `kv_offload`).
    """

    num_blocks: int  # block ids the scheduler hands out (reserved ids follow them)
    layer_caches: tuple[torch.Tensor, ...]  # per layer of the runner's `KVCacheLayout`
    page_bytes: int  # bytes of one block id in one layer slot


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Where a runner sits among the engine's workers."""

    world_size: int = 1  # worker processes (ranks) of the engine
    rank: int = 0  # this worker's rank; rank 0 returns the step results
    distributed_executor_backend: str = "uni"  # "uni" (in-process) or "mp" (a process per rank)
    # > 1: the ranks form one tensor parallel group (tokenmill.distributed.parallel_state
    # holds its communicator); a runner of the plugin's own must shard its model itself
    tensor_parallel_size: int = 1
    # > 1: the ranks also form pipeline stages (layout pp x tp, tokenmill.distributed.
    # parallel_state); the core's runner runs a stage's layers only, results come from
    # TP rank 0 of the last stage
    pipeline_parallel_size: int = 1
    # MoE experts split over the TP group's ranks (vLLM's enable_expert_parallel)
    enable_expert_parallel: bool = False
    # activations split along the tokens between TP regions (vLLM's name)
    enable_sequence_parallelism: bool = False
    # > 1: a (dcp, tp) grid; each sequence's KV spread token by token over the dcp ranks
    decode_context_parallel_size: int = 1
    # > 1: a (pcp, tp) grid; each prefill step's tokens split over the pcp ranks
    prefill_context_parallel_size: int = 1


@dataclass(frozen=True, slots=True)
class ModelRunnerContext:
    """Everything a model runner of a plugin's own needs, handed over before the core
    loads any weights. No tokenizer: runners see token ids only."""

    hf_config: Any  # transformers PretrainedConfig of the checkpoint
    model_path: str  # the checkpoint: an HF directory or a .gguf file
    # a fresh iterator over the checkpoint's (HF name, tensor) pairs, read by the core's
    # loaders (tokenmill.model.loader.checkpoint_weights): safetensors one tensor at a
    # time, GGUF dequantized to float32; cast them to `dtype` yourself
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    dtype: torch.dtype  # the engine's compute dtype (EngineArgs.dtype resolved)
    device: torch.device  # the platform's device
    kv_cache: KVCacheSpec  # the model's layers, block size, pool size and KV-group plan
    parallel: ParallelConfig  # where this rank sits; every parallel size
    max_num_batched_tokens: int  # the most tokens one step computes
    max_num_seqs: int  # the most requests one step holds
    max_model_len: int  # the longest sequence (prompt + output)
    seed: int  # EngineArgs.seed: the global RNG of unseeded sampling
    # the activated platform (`tokenmill.platforms.registry.ActivePlatform`): its attention
    # backends, ops, allocators and graph capture, for a runner that uses them
    active_platform: Any = None
    # this rank's process groups as the core builds them (a ParallelState: each group's
    # ranks and the platform's communicator over it); a runner that parallelises by its
    # own means (the tpu plugin's mesh) ignores it
    parallel_state: Any = None
    # model-based speculative decoding (EngineArgs.speculative_config); a runner that
    # declares `speculative` and gets a method runs the draft model itself
    spec_method: str | None = None  # "mtp" or "eagle3"; None: no draft model
    num_speculative_tokens: int = 0  # drafts per request per step
    spec_draft_model: str | None = None  # eagle3: the draft head's checkpoint directory
    # the checkpoint's weight quantization as the engine resolved it: "none" (weights
    # dequantized to `dtype` by `weights()`) or one of ops.quant.QUANT_METHODS, whose
    # `weights()` then yields each quantized layer's codes / scales / offsets (1.8)
    quantization: str = "none"
    # what the attention layers' caches store when it is not `dtype` (an FP8 KV cache,
    # EngineArgs.kv_cache_dtype; the specs in `kv_cache` carry it as `cache_dtype`)
    kv_cache_dtype: torch.dtype | None = None


class ModelRunnerBase(ABC):
    """A model runner: turns each `StepDescription` into a `StepResult`.

    The core's runner (tokenmill.worker.runner.ModelRunner) and a plugin's own both come
    through `tokenmill_model_runner` and implement this. Order of calls, all in the
    worker: `capabilities` and `kv_cache_layout` (at start), `profile` (when the worker
    sizes the KV pool from memory), `bind_kv_cache(pages)`, then `execute` once per step;
    `sleep` / `wake_up` in between when declared; `shutdown` at the end. A runner keeps
    its own per-request state from the steps (`tokenmill.platforms.kit.runner_state.
    RequestStateTable` does that for any runner), samples with vLLM's semantics
    (`tokenmill.platforms.kit.sampler.Sampler`, or equivalent: greedy outputs must equal
    the core's, which conformance tier T3 checks) and writes the KV of block id b of the
    steps into page b of its layers' views.
    """

    @abstractmethod
    def capabilities(self) -> RunnerCapabilities:
        """What this runner supports (the same answer every time)."""

    @abstractmethod
    def kv_cache_layout(self) -> KVCacheLayout:
        """The pages its layers need (the worker sizes and carves the arena from it)."""

    def profile(self, scratch: Callable[[int], KVCachePages]) -> None:  # noqa: B027 - optional
        """Run a dummy step as large as the engine allows (max_num_batched_tokens tokens over
        max_num_seqs requests) on pages from `scratch(num_blocks)` (freed by the worker
        afterwards), so that memory_info afterwards shows the peak a step needs. Must leave
        no request state behind. A runner without one is sized as is."""

    @abstractmethod
    def bind_kv_cache(self, pages: KVCachePages) -> None:
        """Keep the KV of block id b of the steps in page b of `pages`' views."""

    @abstractmethod
    def execute(self, step: StepDescription) -> StepResult:
        """Run one step; return what it sampled (every sampling row) and the logprobs asked."""

    def sleep(self, level: int) -> int:
        """Free the weights' device memory (level 1: keep them in host memory; level 2:
        discard them); returns the bytes freed. Called only when
        `capabilities().sleep_mode`, with no request in flight; the worker frees the KV
        pages itself."""
        raise NotImplementedError(f"{type(self).__name__} declares no sleep mode")

    def wake_up(self, level: int) -> None:
        """Undo `sleep(level)` (level 2: read the weights again); the KV pages are back,
        zeroed, at the same views."""
        raise NotImplementedError(f"{type(self).__name__} declares no sleep mode")

    def shutdown(self) -> None:  # noqa: B027 - optional
        """Release device memory and threads; no call follows."""


class GraphCapture(ABC):
    """Capture and replay of the decode step (one token per request), per batch size.

    The core runner owns static input buffers (token ids, positions and the attention
    metadata's device tensors, sized for the largest bucket); before capture and before
    each replay it writes the step into them in place, padding the batch to the bucket
    with requests that write a scratch block. `capture(batch_size, fn)` is called once per
    bucket at start-up: `fn()` runs the model's forward over the static buffers and
    returns the hidden states [batch_size, hidden]; `replay(batch_size)` reruns what was
    captured and returns the output tensor (the same one each time, for real graphs).
    Attention backends run inside the graph: under replay they must read only the
    metadata's device tensors, which the runner updates in place (host fields such as
    `seq_lens_cpu` are refreshed too, for implementations that rerun eagerly).
    """

    @abstractmethod
    def batch_sizes(self, max_num_seqs: int) -> list[int]:
        """The buckets to capture, ascending, each at most `max_num_seqs`; a decode step of
        n requests runs in the smallest bucket >= n (eagerly when none is)."""

    @abstractmethod
    def capture(self, batch_size: int, fn: Callable[[], torch.Tensor]) -> None:
        """Record `fn` (the forward over the static buffers) for `batch_size`."""

    @abstractmethod
    def replay(self, batch_size: int) -> torch.Tensor:
        """Run the recorded forward of `batch_size`; returns its hidden states."""
