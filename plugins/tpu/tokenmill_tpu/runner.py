"""The plugin's own model runner: the engine step as one jitted JAX call.

`execute(step)` takes the core's self-contained `StepDescription`, keeps per-request state
in the contract's `RequestStateTable`, builds the step's padded int32 inputs on the host,
runs `tokenmill_tpu.model.forward` (KV write, Pallas attention, logits) over the worker's
KV arena, copies the keys and values the step wrote into the arena's pages, and samples
(`tokenmill_tpu.sampler`). The arena is the worker's (`bind_kv_cache`), so the engine's
KV offload tiers copy this runner's blocks as they copy the core's runner's. On JAX's CPU
backend the arena is host memory the step reads directly; on a TPU it is host memory too
(torch cannot hold HBM), copied to the devices each step: correct, not fast (an HBM arena
is the way there, not done). Shapes are
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

from tokenmill.platforms.interfaces import (
    AttentionKind,
    AttentionSpec,
    KVCacheLayout,
    KVCachePages,
    ModelRunnerBase,
    ModelRunnerContext,
    RunnerCapabilities,
    kv_cache_shape,
)
from tokenmill.platforms.kit.runner_state import RequestStateTable, ScheduledRow
from tokenmill.platforms.kit.sampler import Sampler, SamplingRow, prompt_logprobs
from tokenmill.platforms.ops.reference import apply_token_bitmask
from tokenmill.platforms.step import StepDescription, StepResult, StructuredMasks
from tokenmill_tpu.buckets import bucket
from tokenmill_tpu.convert import to_numpy, to_torch
from tokenmill_tpu.kernels import plan_tiles
from tokenmill_tpu.mesh import kv_sharding, make_mesh, shard_params
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

    The worker calls `capabilities`, `kv_cache_layout`, `bind_kv_cache(pages)`, then
    `execute` once per step (`tokenmill.platforms.interfaces.ModelRunnerBase`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict[str, Any],
        rope: np.ndarray,
        *,
        specs: tuple[AttentionSpec, ...],
        layer_slots: tuple[int, ...],
        layer_groups: tuple[int, ...],
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype,
        tensor_parallel_size: int = 1,
        interpret: bool,
        seed: int = 0,
    ) -> None:
        """`specs`, `layer_slots`, `layer_groups`: each layer's attention spec, arena slot
        and KV group (the core's plan, `KVCacheSpec`)."""
        self.cfg = cfg
        self.specs = specs
        self.layer_slots = np.asarray(layer_slots, np.int32)
        self.layer_groups = np.asarray(layer_groups, np.int32)
        self.num_groups = int(self.layer_groups.max()) + 1
        self.linear_groups = {int(g) for g, s in zip(layer_groups, specs)
                              if s.kind == AttentionKind.LINEAR}
        self.block_size = block_size
        self.dtype = dtype
        self.max_pages = -(-max_model_len // block_size)
        self.mesh = make_mesh(tensor_parallel_size)
        self.params = self._place(params)
        self.rope = jnp.asarray(rope)
        self.interpret = interpret
        self.pages: KVCachePages | None = None
        self.shape = StepShape(TILE_SIZE, self.interpret)
        self.requests = RequestStateTable(torch.device("cpu"))
        self.sampler = JaxSampler(seed=seed)
        self.torch_sampler = Sampler()
        self.stats = RunnerStats()
        self._fallback_reasons: set[str] = set()

    def _place(self, params: dict[str, Any]) -> dict[str, Any]:
        """The numpy params on the mesh (split for tensor parallel: tokenmill_tpu.mesh)."""
        return shard_params(self.mesh, self.cfg, params)

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
        specs: tuple[AttentionSpec, ...] | None = None,
        layer_slots: tuple[int, ...] | None = None,
        layer_groups: tuple[int, ...] | None = None,
    ) -> TpuModelRunner:
        """Build from an HF config and HF-named (name, torch tensor) pairs (the core's
        loaders give these), converting every weight once. Without `specs` (standalone:
        tests, benchmarks) every layer is full attention in a slot of its own reading one
        block table, and `num_blocks` gives the runner host pages of its own."""
        cfg = model_config(hf_config)
        params = convert_weights(cfg, weights, dtype)
        rope = rope_tables(hf_config, cfg, hf_config.max_position_embeddings)
        if specs is None:
            specs = tuple(AttentionSpec(AttentionKind.FULL, cfg.num_heads, cfg.num_kv_heads,
                                        cfg.head_size, dtype, block_size)
                          for _ in range(cfg.num_layers))
            layer_slots, layer_groups = tuple(range(cfg.num_layers)), (0,) * cfg.num_layers
        runner = cls(
            cfg, params, rope, specs=specs, layer_slots=layer_slots, layer_groups=layer_groups,
            block_size=block_size, max_model_len=max_model_len, dtype=dtype, seed=seed,
            tensor_parallel_size=tensor_parallel_size, interpret=interpret,
        )
        if num_blocks is not None:
            caches = tuple(torch.zeros(kv_cache_shape(s, num_blocks), dtype=s.dtype) for s in specs)
            page_bytes = caches[0][0, 0].numel() * caches[0].element_size() * 2
            runner.bind_kv_cache(KVCachePages(num_blocks, caches, page_bytes))
        return runner

    @classmethod
    def from_context(cls, context: ModelRunnerContext, *, interpret: bool,
                     tensor_parallel_size: int) -> TpuModelRunner:
        """The runner the core asks for through `tokenmill_model_runner`."""
        kv = context.kv_cache
        return cls.from_weights(
            context.hf_config, context.weights(), dtype=context.dtype,
            block_size=kv.block_size, max_model_len=context.max_model_len,
            tensor_parallel_size=tensor_parallel_size, interpret=interpret, seed=context.seed,
            specs=kv.attention_specs, layer_slots=kv.layer_slots, layer_groups=kv.layer_groups,
        )

    def capabilities(self) -> RunnerCapabilities:
        """Full and sliding-window attention; its KV stays in the worker's pages between
        steps, so KV offload works; no sleep mode, no graphs (a jitted step is its graph)."""
        return RunnerCapabilities(
            attention_kinds=frozenset({AttentionKind.FULL, AttentionKind.SLIDING_WINDOW}),
            kv_offload=True,
        )

    def kv_cache_layout(self) -> KVCacheLayout:
        """Every layer in the contract's layout, in the core's slots."""
        return KVCacheLayout(attention_specs=self.specs, layer_slots=tuple(self.layer_slots.tolist()))

    def bind_kv_cache(self, pages: KVCachePages) -> None:
        self.pages = pages
        # one attention layer per arena slot: the view the step reads slot s through
        attention = np.array([s.kind != AttentionKind.LINEAR for s in self.specs])
        self._slot_layers = [int(np.flatnonzero((self.layer_slots == s) & attention)[0])
                             for s in range(int(self.layer_slots.max()) + 1)]
        self._sharding = kv_sharding(self.mesh, self.cfg, 6, head_axis=4)

    def shutdown(self) -> None:
        self.pages = None
        self.params = {}

    def _arena(self) -> jax.Array:
        """The arena's slots as one array [slots, 2, blocks, block_size, kv_heads, head]."""
        caches = self.pages.layer_caches
        host = np.stack([to_numpy(caches[j]) for j in self._slot_layers])
        return jax.device_put(host, self._sharding)

    def _write_back(self, keys: jax.Array, values: jax.Array, slots: np.ndarray,
                    num_tokens: int) -> None:
        """The step's keys and values [layers, T, kv_heads, head] into each layer's pages
        at its group's token slots (the first `num_tokens` rows: the rest is padding)."""
        keys, values = to_torch(keys), to_torch(values)
        for layer, cache in enumerate(self.pages.layer_caches):
            if self.specs[layer].kind == AttentionKind.LINEAR:
                continue
            _, num_blocks, block_size, heads, head = cache.shape
            flat = cache.view(2, num_blocks * block_size, heads, head)
            index = torch.from_numpy(slots[self.layer_groups[layer], :num_tokens].astype(np.int64))
            flat[0, index] = keys[layer, :num_tokens].to(cache.dtype)
            flat[1, index] = values[layer, :num_tokens].to(cache.dtype)

    def execute(self, step: StepDescription) -> StepResult:
        """Run one step; returns the sampled tokens (and logprobs where asked)."""
        if self.pages is None:
            raise RuntimeError("TpuModelRunner.bind_kv_cache must run before execute")
        batch = self.requests.update(step)
        result = StepResult()
        if not batch:
            return result
        inputs, sample_rows, lp_rows = self._inputs(batch, step)
        logits = self._run(inputs, batch)
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

    def _run(self, inputs: dict, batch: list[ScheduledRow]) -> jax.Array:
        """The step's forward over the arena; the keys and values it wrote go into the
        pages. Returns the logits of the sample rows."""
        logits, keys, values = forward(self.params, self._arena(), inputs, cfg=self.cfg,
                                       shape=self.shape)
        self._write_back(keys, values, inputs["slots"], sum(r.num_tokens for r in batch))
        return logits

    # -- inputs --------------------------------------------------------------------------

    def _inputs(self, batch: list[ScheduledRow], step: StepDescription):
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        # padding tokens (and every token in a LINEAR group) write past the pages: dropped
        dropped = self.pages.layer_caches[0].shape[1] * self.block_size
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
            slots.append([
                np.full(n, dropped) if g in self.linear_groups else
                np.asarray(table, np.int64)[pos // self.block_size] * self.block_size
                + pos % self.block_size for g, table in enumerate(row.state.tables())
            ])
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
        tables = np.zeros((self.num_groups, num_seqs, self.max_pages), np.int32)
        for i, row in enumerate(batch):
            for g, table in enumerate(row.state.tables()):
                tables[g, i, : len(table)] = table[: self.max_pages]

        def padded(values, size: int, fill: int) -> np.ndarray:
            out = np.full(size, fill, np.int32)
            out[: len(values)] = values
            return out

        group_slots = np.stack([padded(np.concatenate([s[g] for s in slots]), num_tokens, dropped)
                                for g in range(self.num_groups)])
        inputs = {
            "input_ids": padded(ids, num_tokens, 0),
            "positions": padded(np.concatenate(positions), num_tokens, 0),
            "slots": group_slots,
            "layer_slots": self.layer_slots,
            "layer_groups": self.layer_groups,
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
