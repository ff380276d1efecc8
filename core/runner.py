"""The model runner: turns a step description into tensors, runs the graph, samples.

The only device-aware part of the engine step. It never branches on a vendor: the device
comes from the platform, attention from the platform's backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from tokenmill.decode_graphs import DecodeGraphs
from tokenmill.kv.arena import KVArena
from tokenmill.ops.reference import apply_token_bitmask as reference_apply_token_bitmask
from tokenmill.platforms.interfaces import (
    Allocator,
    AttentionKind,
    AttentionMetadata,
    GraphCapture,
    ModelRunnerBase,
    RecurrentStateMetadata,
    recurrent_metadata,
    token_positions,
)
from tokenmill.runner_state import RequestStateTable, ScheduledRow
from tokenmill.sampler import Sampler, SamplingRow, prompt_logprobs
from tokenmill.step import StepDescription, StepResult, StructuredMasks

logger = logging.getLogger(__name__)


class ModelRunner(ModelRunnerBase):
    """The core's runner: the core's model graph over the platform's attention and ops."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_allocator: Allocator,
        block_size: int,
        device: torch.device,
        apply_token_bitmask: Callable = reference_apply_token_bitmask,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int = 8192,
        graphs: GraphCapture | None = None,
    ) -> None:
        """`graphs`: the platform's decode-step capture (None: every step runs eagerly)."""
        self.model = model
        self.kv_allocator = kv_allocator
        self.arena: KVArena | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.backends = model.attention_backends  # distinct backends of the model's layers
        self.block_size = block_size
        self.device = device
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.graphs = graphs
        self.decode_graphs: DecodeGraphs | None = None
        self.sampler = Sampler()
        self.requests = RequestStateTable(device)  # the worker's per-request state
        self.apply_token_bitmask = apply_token_bitmask  # the platform's op (or the reference)

    # ---- ModelRunnerBase -------------------------------------------------------------
    def kv_block_bytes(self) -> int:
        return KVArena.block_bytes_for(
            self.model.attention_specs, self.model.kv_layout.layer_slot, self.model.layer_backends
        )

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks the runner adds to the pool for itself: the graphs' padding block."""
        return 1 if self.graphs is not None else 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """An arena of `num_blocks` blocks (plus the graphs' scratch block), then the
        decode graphs captured over it."""
        self.arena = KVArena.create(
            self.kv_allocator, self.model.attention_specs,
            num_blocks=num_blocks + self.num_reserved_blocks, device=self.device,
            layer_slots=self.model.kv_layout.layer_slot, backends=self.model.layer_backends,
        )
        self.kv_caches = self.arena.layer_caches
        if self.graphs is not None and len(self.model.kv_layout.groups) > 1:
            # captured decode steps bind one block table; KV groups have one each
            logger.warning("decode graphs are off: the model has %d KV groups (hybrid "
                           "attention)", len(self.model.kv_layout.groups))
            self.graphs = None
        if self.graphs is not None:
            self.decode_graphs = DecodeGraphs(
                self.graphs, self.model, self.kv_caches, self.backends,
                scratch_block=num_blocks, block_size=self.block_size,
                max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                device=self.device,
            )
            with torch.inference_mode():
                self.decode_graphs.capture()

    @torch.inference_mode()
    def profile(self) -> None:
        """A prefill of max_num_batched_tokens tokens over min(max_num_seqs, tokens)
        sequences, with their logits, on a scratch KV arena freed afterwards."""
        num_tokens = self.max_num_batched_tokens
        num_seqs = min(self.max_num_seqs, num_tokens)
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        per_seq = [-(-n // self.block_size) for n in lens]
        layout = self.model.kv_layout
        state_pages = max((g.state_pages for g in layout.groups), default=0)
        # every KV group reads the same blocks here: the step measures memory, not values
        scratch = KVArena.create(
            self.kv_allocator, self.model.attention_specs,
            num_blocks=max(sum(per_seq), state_pages),
            device=self.device, layer_slots=layout.layer_slot,
            backends=self.model.layer_backends,
        )
        try:
            first = [sum(per_seq[:i]) for i in range(num_seqs)]
            block_ids = [list(range(f, f + n)) for f, n in zip(first, per_seq)]
            metadata = AttentionMetadata.build(lens, lens, block_ids, self.block_size, self.device)
            if state_pages:  # recurrent groups: every sequence fresh, on one scratch slot
                slot = list(range(state_pages))
                states = RecurrentStateMetadata(
                    [slot] * num_seqs, [None] * num_seqs, [[] for _ in lens]
                )
                linear = recurrent_metadata(lens, lens, states, self.block_size, self.device)
                metadata = [
                    linear if g.kind == AttentionKind.LINEAR else metadata for g in layout.groups
                ]
            for backend in self.backends:
                for m in metadata if isinstance(metadata, list) else [metadata]:
                    if (backend.kind == AttentionKind.LINEAR) == (m.recurrent is not None):
                        backend.prepare(m)
            _, positions = token_positions(lens, lens)
            input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
            hidden = self.model(input_ids, positions.to(self.device), scratch.layer_caches, metadata)
            if hidden is not None:  # None: a pipeline stage before the last
                last = torch.tensor(lens, device=self.device).cumsum(0) - 1
                self.model.compute_logits(hidden[last])
        finally:
            self.kv_allocator.free(scratch.buffer)

    def shutdown(self) -> None:
        if self.arena is not None:
            self.kv_allocator.free(self.arena.buffer)
            self.arena, self.kv_caches = None, []

    @torch.inference_mode()
    def execute(self, step: StepDescription) -> StepResult:
        """Run one step. `step.structured`: structured output's token masks for some
        sampling rows, applied to their logits before sampling (so logprobs are of the
        masked distribution)."""
        if self.arena is None:
            raise RuntimeError("ModelRunner.execute before initialize_kv_cache")
        batch = self.requests.update(step)
        out = StepResult()
        if not batch:
            return out
        inputs = self._prepare_inputs(batch, step)
        hidden = self._forward(batch, inputs)
        if hidden is None:  # a pipeline stage before the last: its activations went on
            return out
        if inputs.sample_rows:
            self._sample(hidden, inputs.sample_rows, inputs.sample_indices, step, out)
        for rid, (indices, (lo, hi)) in inputs.prompt_logprob_rows.items():
            logits = self.model.compute_logits(hidden[indices])
            state = self.requests.requests[rid]
            # the logits at position p predict the token at p + 1
            next_ids = state.token_ids(lo + 1, hi + 1)
            k = state.sampling.prompt_logprobs
            out.prompt_logprobs[rid] = (lo, prompt_logprobs(logits, next_ids, k))
        return out

    def _forward(self, batch: list[ScheduledRow], inputs: _StepInputs) -> torch.Tensor | None:
        """Hidden states of every token of the step: by graph replay for a decode-only
        step that fits a captured bucket, eagerly otherwise. None on a pipeline stage
        before the last (tokenmill.model.pipeline)."""
        if self.decode_graphs is not None:
            bucket = self.decode_graphs.bucket_for(batch)
            if bucket is not None:
                return self.decode_graphs.run(batch, bucket)
        dev = self.device
        # one metadata per KV group (a hybrid model's groups have their own block tables)
        tables = [r.state.tables() for r in batch]
        per_group = [
            self._recurrent_metadata(batch, inputs, [t[g] for t in tables], g)
            if group.kind == AttentionKind.LINEAR
            else AttentionMetadata.build(
                inputs.query_lens, inputs.seq_lens, [t[g] for t in tables], self.block_size, dev
            )
            for g, group in enumerate(self.model.kv_layout.groups)
        ]
        _, positions = token_positions(inputs.query_lens, inputs.seq_lens)
        for group_metadata, group in zip(per_group, self.model.kv_layout.groups, strict=True):
            for backend in self.backends:
                if (backend.kind == AttentionKind.LINEAR) == (group.kind == AttentionKind.LINEAR):
                    backend.prepare(group_metadata)
        metadata = per_group[0] if len(per_group) == 1 else per_group
        input_ids = torch.tensor(inputs.token_ids, dtype=torch.int64, device=dev)
        return self.model(input_ids, positions.to(dev), self.kv_caches, metadata)

    def _recurrent_metadata(
        self, batch: list[ScheduledRow], inputs: _StepInputs, slots: list[list[int]],
        group_id: int,
    ) -> AttentionMetadata:
        """Where each row's state is read from and written to in LINEAR group `group_id`
        (`slots`: each row's state slot, its block table in that group): the slot; zeros at
        token 0; a hit's checkpoint the first step after the hit."""
        sources, checkpoints = [], []
        for row, slot in zip(batch, slots, strict=True):
            op = row.state.recurrent_ops.get(group_id)
            if op is not None and op.restore_block_ids:
                sources.append(list(op.restore_block_ids))
            else:
                sources.append(slot if row.start > 0 else None)
            checkpoints.append(
                [(n - row.start, list(ids)) for n, ids in op.checkpoints] if op is not None else []
            )
        return recurrent_metadata(
            inputs.query_lens, inputs.seq_lens,
            RecurrentStateMetadata(slots, sources, checkpoints), self.block_size, self.device,
        )

    def _sample(
        self,
        hidden: torch.Tensor,
        sample_rows: list[ScheduledRow],
        sample_indices: torch.Tensor,
        step: StepDescription,
        out: StepResult,
    ) -> None:
        logits = self.model.compute_logits(hidden[sample_indices])
        rows = [
            SamplingRow(
                params=r.state.sampling,
                prompt_token_ids=r.state.prompt_token_ids,
                output_token_ids=r.state.output_token_ids,
                generator=r.state.generator,
            )
            for r in sample_rows
        ]
        if step.structured is not None:
            self._apply_masks(logits, rows, step.structured)
        sampled = self.sampler(logits, rows)
        for r, token_id, lp in zip(sample_rows, sampled.token_ids, sampled.logprobs):
            rid = r.state.request_id
            out.sampled_token_ids[rid] = token_id
            if lp is not None:
                out.logprobs[rid] = lp

    def _apply_masks(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: StructuredMasks
    ) -> None:
        words = np.frombuffer(masks.bitmask, dtype="<i4").reshape(-1, masks.num_words)
        self.apply_token_bitmask(
            logits,
            torch.from_numpy(words.copy()).to(logits.device),
            torch.tensor(masks.row_indices, dtype=torch.int64, device=logits.device),
        )
        for i in masks.ended_rows:
            # a complete constraint allows only EOS: it wins over min_tokens, which would
            # otherwise mask EOS too and leave nothing to sample
            if rows[i].params.min_tokens:
                rows[i].params = msgspec.structs.replace(rows[i].params, min_tokens=0)

    def _prepare_inputs(self, batch: list[ScheduledRow], step: StepDescription) -> _StepInputs:
        token_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[ScheduledRow] = []
        sample_indices: list[int] = []
        lp_rows: dict[str, tuple[list[int], tuple[int, int]]] = {}
        for row in batch:
            n, start = row.num_tokens, row.start
            offset = len(token_ids)
            token_ids.extend(row.state.token_ids(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            if row.sample:
                sample_rows.append(row)
                sample_indices.append(offset + n - 1)
            rid = row.state.request_id
            lo, hi = step.prompt_logprob_ranges.get(rid, (0, 0))
            if hi > lo:
                idx = [offset + p - start for p in range(lo, hi)]
                lp_rows[rid] = (idx, (lo, hi))
        dev = self.device
        return _StepInputs(
            token_ids=token_ids,
            query_lens=query_lens,
            seq_lens=seq_lens,
            sample_rows=sample_rows,
            sample_indices=torch.tensor(sample_indices, dtype=torch.int64, device=dev),
            prompt_logprob_rows={
                rid: (torch.tensor(idx, dtype=torch.int64, device=dev), span)
                for rid, (idx, span) in lp_rows.items()
            },
        )


@dataclass(slots=True)
class _StepInputs:
    token_ids: list[int]  # [num_tokens], flattened request by request
    query_lens: list[int]  # per request: tokens computed this step
    seq_lens: list[int]  # per request: context length including them
    sample_rows: list[ScheduledRow]  # the rows that sample, in row order
    sample_indices: torch.Tensor  # int64 [len(sample_rows)]: their last token's index
    # request id -> (token indices, prompt positions [lo, hi)) for prompt logprobs
    prompt_logprob_rows: dict[str, tuple[torch.Tensor, tuple[int, int]]]
