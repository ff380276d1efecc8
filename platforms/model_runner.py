"""The plugin seam for whole model runners and decode-step graphs: what a runner of a
plugin's own gets (`ModelRunnerContext`, `KVCacheSpec`, `ParallelConfig`), what it
implements (`ModelRunnerBase`), and what `tokenmill_graph_capture` returns
(`GraphCapture`). `tokenmill.platforms.interfaces` re-exports every name here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.step import StepDescription, StepResult

if TYPE_CHECKING:
    from tokenmill.platforms.interfaces import AttentionSpec


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The KV cache a model runner must provide: one page per layer per block."""

    attention_specs: tuple[AttentionSpec, ...]  # one per layer, in layer order
    block_size: int  # tokens per block
    # fixed by the user (EngineArgs.num_kv_blocks); None: the core sizes the pool after
    # `ModelRunnerBase.profile`, from the platform's memory_info, and passes the number to
    # `initialize_kv_cache`
    num_blocks: int | None = None
    num_bytes: int | None = None  # EngineArgs.kv_cache_memory_bytes; None: from memory_info


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
    kv_cache: KVCacheSpec
    parallel: ParallelConfig
    max_num_batched_tokens: int  # the most tokens one step computes
    max_num_seqs: int  # the most requests one step holds
    max_model_len: int  # the longest sequence (prompt + output)
    seed: int  # EngineArgs.seed: the global RNG of unseeded sampling


class ModelRunnerBase(ABC):
    """A model runner: turns each `StepDescription` into a `StepResult`.

    The core's runner (tokenmill.runner.ModelRunner) and a plugin's own (returned by
    `tokenmill_model_runner`) both implement this. Order of calls, all in the worker:
    `kv_block_bytes`, `profile`, `initialize_kv_cache(num_blocks)`, then `execute` once per
    step, `shutdown` at the end. A runner keeps its own per-request state from the steps
    (`tokenmill.runner_state.RequestStateTable` does that for any runner), samples with
    vLLM's semantics (`tokenmill.sampler.Sampler`, or equivalent: greedy outputs must equal
    the core's, which conformance tier T3 checks) and writes the KV of block id b of the
    steps into its own pages.
    """

    @abstractmethod
    def kv_block_bytes(self) -> int:
        """Bytes one KV block takes on the device, over all layers (to size the pool)."""

    def profile(self) -> None:  # noqa: B027 - optional: a runner without one is sized as is
        """Run a dummy step as large as the engine allows (max_num_batched_tokens tokens over
        max_num_seqs requests), so that memory_info afterwards shows the peak a step needs.
        Must leave no request state behind."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache: block ids 0..num_blocks-1 name pages of every layer."""

    @abstractmethod
    def execute(self, step: StepDescription) -> StepResult:
        """Run one step; return what it sampled (every sampling row) and the logprobs asked."""

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
