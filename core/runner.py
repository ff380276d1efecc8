"""The model runner: turns a step description into tensors, runs the graph, samples.

The only device-aware part of the engine step. It never branches on a vendor: the device
comes from the platform, attention from the platform's backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from tokenmill.ops.reference import apply_token_bitmask as reference_apply_token_bitmask
from tokenmill.platforms.interfaces import AttentionMetadata, token_positions
from tokenmill.request import Request
from tokenmill.sampler import Logprobs, Sampler, SamplingRow, prompt_logprobs
from tokenmill.scheduler import SchedulerOutput
from tokenmill.structured.manager import StructuredStep


@dataclass(slots=True)
class RunnerOutput:
    """Per sampled request: the new token and, if asked, its logprobs."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # request id -> (start, logprobs of prompt positions [start, end)) computed this step
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)


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
        self.apply_token_bitmask = apply_token_bitmask  # the platform's op (or the reference)

    @torch.inference_mode()
    def execute(
        self,
        step: SchedulerOutput,
        requests: Mapping[str, Request],
        masks: StructuredStep | None = None,
    ) -> RunnerOutput:
        """Run one step. `masks`: structured output's token masks for some sampling rows,
        applied to their logits before sampling (so logprobs are of the masked
        distribution)."""
        inputs = self._prepare_inputs(step)
        for backend in self.backends:
            backend.prepare(inputs.metadata)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)

        out = RunnerOutput()
        if inputs.sample_rows:
            logits = self.model.compute_logits(hidden[inputs.sample_indices])
            rows = [
                SamplingRow(
                    params=requests[rid].sampling_params,
                    prompt_token_ids=requests[rid].prompt_token_ids,
                    output_token_ids=requests[rid].output_token_ids,
                    generator=requests[rid].generator,
                )
                for rid in inputs.sample_rows
            ]
            if masks is not None:
                self._apply_masks(logits, rows, masks)
            sampled = self.sampler(logits, rows)
            for rid, token_id, lp in zip(inputs.sample_rows, sampled.token_ids, sampled.logprobs):
                out.sampled[rid] = token_id
                if lp is not None:
                    out.logprobs[rid] = lp
        for rid, (indices, (lo, hi)) in inputs.prompt_logprob_rows.items():
            logits = self.model.compute_logits(hidden[indices])
            request = requests[rid]
            # the logits at position p predict the token at p + 1
            next_ids = request.all_token_ids[lo + 1 : hi + 1]
            k = request.sampling_params.prompt_logprobs
            out.prompt_logprobs[rid] = (lo, prompt_logprobs(logits, next_ids, k))
        return out

    def _apply_masks(self, logits: torch.Tensor, rows: list[SamplingRow], masks: StructuredStep) -> None:
        self.apply_token_bitmask(
            logits,
            masks.bitmask.to(logits.device),
            torch.tensor(masks.row_indices, dtype=torch.int64, device=logits.device),
        )
        for i in masks.ended_rows:
            # a complete constraint allows only EOS: it wins over min_tokens, which would
            # otherwise mask EOS too and leave nothing to sample
            if rows[i].params.min_tokens:
                rows[i].params = dataclasses.replace(rows[i].params, min_tokens=0)

    def _prepare_inputs(self, step: SchedulerOutput) -> _StepInputs:
        token_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[str] = []
        sample_indices: list[int] = []
        lp_rows: dict[str, tuple[list[int], tuple[int, int]]] = {}
        for s in step.scheduled:
            n = len(s.token_ids)
            offset = len(token_ids)
            token_ids.extend(s.token_ids)
            query_lens.append(n)
            seq_lens.append(s.start_position + n)
            if s.sample:
                sample_rows.append(s.request_id)
                sample_indices.append(offset + n - 1)
            lo, hi = s.prompt_logprobs_range
            if hi > lo:
                idx = [offset + p - s.start_position for p in range(lo, hi)]
                lp_rows[s.request_id] = (idx, (lo, hi))

        dev = self.device
        metadata = AttentionMetadata.build(
            query_lens, seq_lens, [s.block_ids for s in step.scheduled], self.block_size, dev
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
    sample_rows: list[str]  # request ids that sample, in row order
    sample_indices: torch.Tensor  # int64 [len(sample_rows)]: their last token's index
    # request id -> (token indices, prompt positions [lo, hi)) for prompt logprobs
    prompt_logprob_rows: dict[str, tuple[torch.Tensor, tuple[int, int]]]
