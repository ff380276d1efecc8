"""The plugin's own model runner: the engine step as one jitted JAX call.

`execute(step)` takes the core's self-contained `StepDescription`, keeps per-request state
in the core's `RequestStateTable`, builds the step's padded int32 inputs on the host,
runs `tokenmill_tpu.model.forward` (KV write, Pallas attention, logits; the KV array is
donated, so it is updated in place) and samples (`tokenmill_tpu.sampler`). Shapes are
bucketed by token count and sequence count only (`tokenmill_tpu.buckets`; query tiles,
sampled rows and the block table width follow from them or from max_model_len), so a run
compiles a handful of shapes and none once warm (`tokenmill_tpu.compiles` counts them).

Tensor parallelism is sharding: with a mesh of N devices the attention and MLP weights
are split by heads and by the intermediate dimension (`tokenmill_tpu.mesh`), the KV cache
by KV heads where they divide, and XLA inserts the collectives (all-reduce after the
output and down projections).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import torch

from tokenmill.ops.reference import apply_token_bitmask
from tokenmill.platforms.interfaces import ModelRunnerBase, ModelRunnerContext
from tokenmill.runner_state import RequestStateTable, ScheduledRow
from tokenmill.sampler import Sampler, SamplingRow, prompt_logprobs
from tokenmill.step import StepDescription, StepResult, StructuredMasks
from tokenmill_tpu.buckets import bucket
from tokenmill_tpu.convert import numpy_dtype, to_torch
from tokenmill_tpu.kernels import plan_tiles
from tokenmill_tpu.mesh import make_mesh, shard_params, zeros_kv
from tokenmill_tpu.model import ModelConfig, StepShape, forward, model_config
from tokenmill_tpu.sampler import JaxSampler, fallback_reason
from tokenmill_tpu.weights import convert_weights, rope_tables

logger = logging.getLogger(__name__)

TILE_SIZE = 8
MIN_TOKENS_BUCKET = 16
MIN_SEQS_BUCKET = 4


@dataclass(slots=True)
class RunnerStats:
    steps: int = 0
    shapes: set[tuple[int, int, int]] = field(default_factory=set)  # (tokens, seqs, rows)


class TpuModelRunner(ModelRunnerBase):
    """Runs steps of one model on the JAX devices of its mesh (all of them: tensor parallel).

    The core calls `kv_block_bytes`, `initialize_kv_cache(num_blocks)`, then `execute`
    once per step (`tokenmill.platforms.interfaces.ModelRunnerBase`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict[str, Any],
        rope: np.ndarray,
        *,
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype,
        tensor_parallel_size: int = 1,
        interpret: bool,
        seed: int = 0,
    ) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.dtype = dtype
        self.max_pages = -(-max_model_len // block_size)
        self.mesh = make_mesh(tensor_parallel_size)
        self.params = shard_params(self.mesh, cfg, params)
        self.rope = jnp.asarray(rope)
        self.interpret = interpret
        self.num_blocks = 0
        self.kv: jax.Array | None = None
        self.shape: StepShape | None = None
        self.requests = RequestStateTable(torch.device("cpu"))
        self.sampler = JaxSampler(seed=seed)
        self.torch_sampler = Sampler()
        self.stats = RunnerStats()
        self._fallback_reasons: set[str] = set()

    @classmethod
    def from_weights(
        cls,
        hf_config: Any,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        dtype: torch.dtype,
        block_size: int,
        max_model_len: int,
        num_blocks: int | None = None,
        tensor_parallel_size: int = 1,
        interpret: bool,
        seed: int = 0,
    ) -> TpuModelRunner:
        """Build from an HF config and HF-named (name, torch tensor) pairs (the core's
        loaders give these), converting every weight once; with `num_blocks`, also
        allocate the KV cache."""
        cfg = model_config(hf_config)
        params = convert_weights(cfg, weights, dtype)
        rope = rope_tables(hf_config, cfg, hf_config.max_position_embeddings)
        runner = cls(
            cfg, params, rope, block_size=block_size, max_model_len=max_model_len,
            dtype=dtype, seed=seed, tensor_parallel_size=tensor_parallel_size,
            interpret=interpret,
        )
        if num_blocks is not None:
            runner.initialize_kv_cache(num_blocks)
        return runner

    @classmethod
    def from_context(cls, context: ModelRunnerContext, *, interpret: bool,
                     tensor_parallel_size: int) -> TpuModelRunner:
        """The runner the core asks for through `tokenmill_model_runner`."""
        return cls.from_weights(
            context.hf_config, context.weights(), dtype=context.dtype,
            block_size=context.kv_cache.block_size, max_model_len=context.max_model_len,
            tensor_parallel_size=tensor_parallel_size, interpret=interpret, seed=context.seed,
        )

    def kv_block_bytes(self) -> int:
        """One block of every layer: block_size x 2 x kv_heads x head_size elements each."""
        cfg = self.cfg
        itemsize = numpy_dtype(self.dtype).itemsize
        return cfg.num_layers * self.block_size * 2 * cfg.kv_size * itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        cfg = self.cfg
        shape = (cfg.num_layers, num_blocks, self.block_size, 2 * cfg.num_kv_heads, cfg.head_size)
        self.num_blocks = num_blocks
        self.kv = zeros_kv(self.mesh, cfg, shape, numpy_dtype(self.dtype))
        self.shape = StepShape(TILE_SIZE, self.interpret, kv_sharding=self.kv.sharding)

    def shutdown(self) -> None:
        self.kv = None
        self.params = {}

    def execute(self, step: StepDescription) -> StepResult:
        """Run one step; returns the sampled tokens (and logprobs where asked)."""
        if self.kv is None:
            raise RuntimeError("TpuModelRunner.initialize_kv_cache must run before execute")
        batch = self.requests.update(step)
        result = StepResult()
        if not batch:
            return result
        inputs, sample_rows, lp_rows = self._inputs(batch, step)
        logits, self.kv = forward(self.params, self.kv, inputs, cfg=self.cfg, shape=self.shape)
        self.stats.steps += 1
        self.stats.shapes.add((len(inputs["input_ids"]), len(inputs["seq_lens"]), logits.shape[0]))
        if sample_rows:
            self._sample(logits, sample_rows, step, result)
        for rid, (first_row, (lo, hi)) in lp_rows.items():
            state = self.requests.requests[rid]
            rows = to_torch(logits[first_row : first_row + hi - lo])
            next_ids = state.token_ids(lo + 1, hi + 1)
            result.prompt_logprobs[rid] = (
                lo, prompt_logprobs(rows, next_ids, state.sampling.prompt_logprobs),
            )
        return result

    # -- inputs --------------------------------------------------------------------------

    def _inputs(self, batch: list[ScheduledRow], step: StepDescription):
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        logit_rows: list[int] = []
        sample_rows: list[ScheduledRow] = []
        lp_rows: dict[str, tuple[int, tuple[int, int]]] = {}
        offsets = []  # each row's first token in the flat batch
        for row in batch:
            start, n = row.start, row.num_tokens
            offset = len(ids)
            offsets.append(offset)
            ids += row.state.token_ids(start, start + n)
            pos = np.arange(start, start + n)
            positions.append(pos)
            table = np.asarray(row.state.block_ids, np.int64)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_lens.append(n)
            seq_lens.append(start + n)
            if row.sample:
                sample_rows.append(row)
                logit_rows.append(offset + n - 1)
        for row, offset in zip(batch, offsets):  # prompt-logprob rows after the sampling rows
            rid = row.state.request_id
            lo, hi = step.prompt_logprob_ranges.get(rid, (0, 0))
            if hi > lo:
                lp_rows[rid] = (len(logit_rows), (lo, hi))
                logit_rows += [offset + p - row.start for p in range(lo, hi)]
        num_tokens = bucket(len(ids), MIN_TOKENS_BUCKET)
        num_seqs = bucket(len(batch), MIN_SEQS_BUCKET)
        num_rows = bucket(len(logit_rows), num_seqs)
        plan = plan_tiles(query_lens, seq_lens, TILE_SIZE, num_seqs + num_tokens // TILE_SIZE,
                          num_tokens)
        tables = np.zeros((num_seqs, self.max_pages), np.int32)
        for i, row in enumerate(batch):
            tables[i, : len(row.state.block_ids)] = row.state.block_ids[: self.max_pages]

        def padded(values, size: int, fill: int) -> np.ndarray:
            out = np.full(size, fill, np.int32)
            out[: len(values)] = values
            return out

        dropped = self.num_blocks * self.block_size  # padding tokens write past the cache
        inputs = {
            "input_ids": padded(ids, num_tokens, 0),
            "positions": padded(np.concatenate(positions), num_tokens, 0),
            "slots": padded(np.concatenate(slots), num_tokens, dropped),
            "tile_seq": plan.tile_seq, "tile_pos": plan.tile_pos, "tile_len": plan.tile_len,
            "tile_token": plan.tile_token, "token_tile": plan.token_tile,
            "token_row": plan.token_row,
            "seq_lens": padded(seq_lens, num_seqs, 0),
            "block_tables": tables,
            "sample_rows": padded(logit_rows, num_rows, 0),
            "rope": self.rope,
        }
        return inputs, sample_rows, lp_rows

    # -- sampling ------------------------------------------------------------------------

    def _sample(
        self, logits: jax.Array, rows: list[ScheduledRow], step: StepDescription,
        result: StepResult,
    ) -> None:
        states = [r.state for r in rows]
        reasons = [fallback_reason(s.sampling, s) for s in states]
        if step.structured is not None:
            reasons = ["structured output" if i in _masked_rows(step.structured) else r
                       for i, r in enumerate(reasons)]
        if not any(reasons):
            ids = self.sampler.sample(logits[: max(len(rows), 1)], states, step.step_id)
            for state, token in zip(states, ids, strict=True):
                result.sampled_token_ids[state.request_id] = token
            return
        self._torch_sample(logits, states, reasons, step, result)

    def _torch_sample(self, logits, states, reasons, step, result) -> None:
        """All sampling rows through the core's torch sampler (same semantics as the
        reference platform, torch's RNG), because some row needs what JAX does not do."""
        for reason in set(filter(None, reasons)) - self._fallback_reasons:
            logger.info("tpu sampler: %s runs on the core's torch sampler (host logits)", reason)
            self._fallback_reasons.add(reason)
        self.sampler.num_fallback_rows += len(states)
        host = to_torch(logits[: len(states)])
        sampling_rows = [
            SamplingRow(params=s.sampling, prompt_token_ids=s.prompt_token_ids,
                        output_token_ids=s.output_token_ids, generator=s.generator)
            for s in states
        ]
        masks = step.structured
        if masks is not None:
            words = np.frombuffer(masks.bitmask, dtype="<i4").reshape(-1, masks.num_words)
            apply_token_bitmask(host, torch.from_numpy(words.copy()),
                                torch.tensor(masks.row_indices, dtype=torch.int64))
            for i in masks.ended_rows:
                if sampling_rows[i].params.min_tokens:
                    sampling_rows[i].params = msgspec.structs.replace(
                        sampling_rows[i].params, min_tokens=0
                    )
        sampled = self.torch_sampler(host, sampling_rows)
        for state, token, lp in zip(states, sampled.token_ids, sampled.logprobs, strict=True):
            result.sampled_token_ids[state.request_id] = token
            if lp is not None:
                result.logprobs[state.request_id] = lp


def _masked_rows(masks: StructuredMasks) -> set[int]:
    return set(masks.row_indices) | set(masks.ended_rows)
