"""The model runner: turns a step description into tensors, runs the graph, samples.

The only device-aware part of the engine step. It never branches on a vendor: the device
comes from the platform, attention from the platform's backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from tokenmill.kv_connector.worker import KVConnectorWorker
from tokenmill.ops.reference import apply_token_bitmask as reference_apply_token_bitmask
from tokenmill.platforms.interfaces import AttentionMetadata, token_positions
from tokenmill.runner_state import RequestStateTable, ScheduledRow
from tokenmill.sampler import Sampler, SamplingRow, prompt_logprobs
from tokenmill.step import StepDescription, StepResult, StructuredMasks


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        attention_backends: list,
        block_size: int,
        device: torch.device,
        apply_token_bitmask: Callable = reference_apply_token_bitmask,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backends = attention_backends  # distinct backends used by the model's layers
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.requests = RequestStateTable(device)  # the worker's per-request state
        self.apply_token_bitmask = apply_token_bitmask  # the platform's op (or the reference)
        self.kv_connector: KVConnectorWorker | None = None  # KV offload's worker side

    @torch.inference_mode()
    def execute(self, step: StepDescription) -> StepResult:
        """Run one step. `step.structured`: structured output's token masks for some
        sampling rows, applied to their logits before sampling (so logprobs are of the
        masked distribution)."""
        batch = self.requests.update(step)
        out = StepResult()
        connector, meta = self.kv_connector, step.kv_connector
        if connector is not None and meta is not None:
            connector.start_prefetch(meta.prefetch)
            connector.start_loads(meta.loads)  # overlapped with this step's forward pass
        if not batch:
            if connector is not None:  # only loads in flight: wait a little for one
                out.kv_connector = connector.report(wait_s=0.005)
            return out
        inputs = self._prepare_inputs(batch, step)
        for backend in self.backends:
            backend.prepare(inputs.metadata)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        if connector is not None:
            if meta is not None:
                connector.save(meta.saves)  # the blocks this step filled
            out.kv_connector = connector.report()

        if inputs.sample_rows:
            logits = self.model.compute_logits(hidden[inputs.sample_indices])
            rows = [
                SamplingRow(
                    params=r.state.sampling,
                    prompt_token_ids=r.state.prompt_token_ids,
                    output_token_ids=r.state.output_token_ids,
                    generator=r.state.generator,
                )
                for r in inputs.sample_rows
            ]
            if step.structured is not None:
                self._apply_masks(logits, rows, step.structured)
            sampled = self.sampler(logits, rows)
            for r, token_id, lp in zip(inputs.sample_rows, sampled.token_ids, sampled.logprobs):
                rid = r.state.request_id
                out.sampled_token_ids[rid] = token_id
                if lp is not None:
                    out.logprobs[rid] = lp
        for rid, (indices, (lo, hi)) in inputs.prompt_logprob_rows.items():
            logits = self.model.compute_logits(hidden[indices])
            state = self.requests.requests[rid]
            # the logits at position p predict the token at p + 1
            next_ids = state.token_ids(lo + 1, hi + 1)
            k = state.sampling.prompt_logprobs
            out.prompt_logprobs[rid] = (lo, prompt_logprobs(logits, next_ids, k))
        return out

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
        metadata = AttentionMetadata.build(
            query_lens, seq_lens, [r.state.block_ids for r in batch], self.block_size, dev
        )
        _, positions = token_positions(query_lens, seq_lens)
        return _StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            metadata=metadata,
            sample_rows=sample_rows,
            sample_indices=torch.tensor(sample_indices, dtype=torch.int64, device=dev),
            prompt_logprob_rows={
                rid: (torch.tensor(idx, dtype=torch.int64, device=dev), span)
                for rid, (idx, span) in lp_rows.items()
            },
        )


@dataclass(slots=True)
class _StepInputs:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    metadata: AttentionMetadata
    sample_rows: list[ScheduledRow]  # the rows that sample, in row order
    sample_indices: torch.Tensor  # int64 [len(sample_rows)]: their last token's index
    # request id -> (token indices, prompt positions [lo, hi)) for prompt logprobs
    prompt_logprob_rows: dict[str, tuple[torch.Tensor, tuple[int, int]]]
