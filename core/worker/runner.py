"""The core's model runner: turns a step description into tensors, runs the graph, samples.

The only device-aware part of the engine step. It never branches on a vendor: the device
comes from the platform, attention from the platform's backend. It is one runner among
others: built by the core's model_runner plugin (tokenmill.worker.runner_plugin) through
`tokenmill_model_runner`, as a platform's own runner is, and given page views of the
worker's KV arena (`bind_kv_cache`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from tokenmill.kv.groups import KVLayout, plan_groups
from tokenmill.model.kv_scales import calibrate_kv_scales, kv_scales_digest, quantized_kv_layers
from tokenmill.platforms.interfaces import (
    Allocator,
    AttentionKind,
    AttentionMetadata,
    GraphCapture,
    KVCacheLayout,
    KVCachePages,
    ModelRunnerBase,
    RecurrentStateMetadata,
    RunnerCapabilities,
    recurrent_metadata,
    token_positions,
)
from tokenmill.platforms.kit.runner_state import RequestStateTable, ScheduledRow
from tokenmill.platforms.kit.sampler import Sampler, SamplingRow, prompt_logprobs
from tokenmill.platforms.kit.spec_verify import VerifyRow, verify
from tokenmill.platforms.ops.reference import apply_token_bitmask as reference_apply_token_bitmask
from tokenmill.platforms.step import StepDescription, StepResult, StructuredMasks
from tokenmill.worker.decode_graphs import DecodeGraphs
from tokenmill.worker.drafting import DraftPlan, DraftProposer, scratch_blocks_per_row
from tokenmill.worker.sleep_mode import release_weights

logger = logging.getLogger(__name__)


class ModelRunner(ModelRunnerBase):
    """The core's runner: the core's model graph over the platform's attention and ops."""

    def __init__(
        self,
        model: torch.nn.Module,
        block_size: int,
        device: torch.device,
        apply_token_bitmask: Callable = reference_apply_token_bitmask,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int = 8192,
        graphs: GraphCapture | None = None,
        weights_allocator: Allocator | None = None,
        reload_weights: Callable[[], object] | None = None,
        draft: DraftProposer | None = None,
    ) -> None:
        """`graphs`: the platform's decode-step capture (None: every step runs eagerly).
        `weights_allocator`: the platform's WEIGHTS allocator holding the parameters (a
        platform with sleep mode), with `reload_weights()` a fresh checkpoint iterator for
        waking from level 2; None: no sleep mode. `draft`: model-based speculative
        decoding's proposer (core/worker/drafting.py), whose draft layers get KV slots of
        their own in the arena."""
        self.model = model
        self.weights_allocator = weights_allocator
        self.reload_weights = reload_weights
        self.kv_caches: list[torch.Tensor] = []
        self.backends = model.attention_backends  # distinct backends of the model's layers
        self.block_size = block_size
        self.device = device
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        if graphs is not None and len(model.kv_layout.groups) > 1:
            # captured decode steps bind one block table; KV groups have one each
            logger.warning("decode graphs are off: the model has %d KV groups (hybrid "
                           "attention)", len(model.kv_layout.groups))
            graphs = None
        self.graphs = graphs
        self.decode_graphs: DecodeGraphs | None = None
        self.sampler = Sampler()
        self.requests = RequestStateTable(device)  # the worker's per-request state
        self.apply_token_bitmask = apply_token_bitmask  # the platform's op (or the reference)
        self.draft = draft
        if draft is not None and graphs is not None:
            logger.warning("decode graphs are off: a draft model (speculative decoding) "
                           "runs after each step's forward")
            self.graphs = None
        self._kv_layout = self._arena_layout()

    def _arena_layout(self) -> KVLayout:
        """The arena's layers: the model's, then the draft model's. The KV groups are
        planned over both (as the engine core plans them); where the draft's layers
        change the grouping (a full-attention MTP layer in a hybrid model), the model
        reads its layers' groups from that plan."""
        layout = self.model.kv_layout
        if self.draft is None:
            return layout
        joint = plan_groups(self._arena_specs)
        n = len(self.model.attention_specs)
        def kinds(groups):
            return [(g.kind, g.sliding_window, g.state) for g in groups]

        if kinds(joint.groups) != kinds(layout.groups) or joint.layer_group[:n] != \
                layout.layer_group:
            logger.info("the draft model's layers regroup the KV arena: %d groups, %d "
                        "slots (the target alone: %d, %d)", len(joint.groups),
                        joint.num_slots, len(layout.groups), layout.num_slots)
            self.model.kv_layout = KVLayout(joint.groups, joint.num_slots,
                                            joint.layer_group[:n], joint.layer_slot[:n],
                                            joint.page_bytes)
        return joint

    @property
    def _arena_specs(self) -> list:
        extra = self.draft.draft.attention_specs if self.draft is not None else []
        return [*self.model.attention_specs, *extra]

    @property
    def _arena_backends(self) -> list:
        extra = self.draft.draft.layer_backends if self.draft is not None else []
        return [*self.model.layer_backends, *extra]

    # ---- ModelRunnerBase -------------------------------------------------------------
    def capabilities(self) -> RunnerCapabilities:
        """Every attention kind (the platform's backends, else the core's references), KV
        offload, speculative drafts, sleep mode where the platform's allocators hold the
        weights, graphs where the platform captures them."""
        return RunnerCapabilities(
            attention_kinds=frozenset(AttentionKind), kv_offload=True, speculative=True,
            sleep_mode=self.weights_allocator is not None, graphs=self.graphs is not None,
        )

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks the runner adds to the pool for itself: the graphs' padding block, the
        draft model's scratch blocks for chained positions (core/worker/drafting.py)."""
        draft = 0
        if self.draft is not None:
            draft = self.max_num_seqs * scratch_blocks_per_row(self.draft.k, self.block_size)
        return (1 if self.graphs is not None else 0) + draft

    def kv_cache_layout(self) -> KVCacheLayout:
        """The model's layers (a pipeline stage's), then the draft model's, in their
        backends' page views, plus the graphs' padding block or the draft's scratch."""
        return KVCacheLayout(
            attention_specs=tuple(self._arena_specs),
            layer_slots=tuple(self._kv_layout.layer_slot),
            backends=tuple(self._arena_backends),
            reserved_blocks=self.num_reserved_blocks,
        )

    def bind_kv_cache(self, pages: KVCachePages) -> None:
        """Keep the KV in `pages` (the draft model's layers after the model's), then
        capture the decode graphs over them (the padding rows write the reserved block, id
        `pages.num_blocks`; graphs and a draft model never go together)."""
        num_layers = len(self.model.attention_specs)
        self.kv_caches = list(pages.layer_caches[:num_layers])
        if self.draft is not None:
            self.draft.plan = DraftPlan(
                list(pages.layer_caches[num_layers:]), self._kv_layout.layer_group[num_layers],
                scratch_base=pages.num_blocks,
                scratch_per_row=scratch_blocks_per_row(self.draft.k, self.block_size),
            )
        if self.graphs is not None:
            self.decode_graphs = DecodeGraphs(
                self.graphs, self.model, self.kv_caches, self.backends,
                scratch_block=pages.num_blocks, block_size=self.block_size,
                max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                device=self.device,
            )
            with torch.inference_mode():
                self.decode_graphs.capture()

    @torch.inference_mode()
    def profile(self, scratch: Callable[[int], KVCachePages]) -> None:
        """A prefill of max_num_batched_tokens tokens over min(max_num_seqs, tokens)
        sequences, with their logits, on scratch pages."""
        num_tokens = self.max_num_batched_tokens
        num_seqs = min(self.max_num_seqs, num_tokens)
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self._scratch_prefill(scratch, lens, input_ids)
        if hidden is not None:  # None: a pipeline stage before the last
            last = torch.tensor(lens, device=self.device).cumsum(0) - 1
            self.model.compute_logits(hidden[last])

    @torch.inference_mode()
    def calibrate_kv_scales(
        self, scratch: Callable[[int], KVCachePages], token_ids: list[int]
    ) -> str:
        """Set the quantized KV cache's scales from one prefill of `token_ids` on `scratch`
        pages laid out for the layers' plain specs (the compute dtype): each layer's k / v
        scale per KV head is the amax it stored / the format's largest value
        (`tokenmill.model.kv_scales.calibrate_kv_scales`). Runs before `bind_kv_cache`,
        once: KV is never stored with other scales. Returns a digest of the scales set (for
        the KV layout's fingerprint; "" when the checkpoint's scales are kept); ValueError when the model's KV cache is not quantized
        or the sample is empty or longer than one step (max_num_batched_tokens) or the
        context (max_model_len)."""
        layers = quantized_kv_layers(self.model)
        if not layers:
            raise ValueError("calibrate_kv_scales: the model's KV cache is not quantized")
        from_checkpoint = self.model.checkpoint_kv_scales
        if from_checkpoint:  # calibrated by whoever made the checkpoint: those win
            logger.warning("calculate_kv_scales: the checkpoint carries KV scales (%s, %d in "
                           "all); they are kept, nothing is calibrated", from_checkpoint[0],
                           len(from_checkpoint))
            return ""
        most = min(self.max_num_batched_tokens, self.max_model_len)
        if not 0 < len(token_ids) <= most:
            raise ValueError(f"calibrate_kv_scales: a sample of {len(token_ids)} tokens; it "
                             f"must hold 1 to {most} (one prefill step)")
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        calibrate_kv_scales(layers, lambda: self._scratch_prefill(scratch, [len(token_ids)],
                                                                   input_ids))
        scales = torch.cat([torch.cat([layer.k_scale, layer.v_scale]) for layer in layers])
        logger.info("KV scales calibrated on %d tokens: %d layers, scales %.3g to %.3g",
                    len(token_ids), len(layers), scales.min().item(), scales.max().item())
        return kv_scales_digest(layers)

    def _scratch_prefill(
        self, scratch: Callable[[int], KVCachePages], lens: list[int], input_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """The model's forward over fresh sequences of `lens` tokens (`input_ids`, all of
        them in order) on scratch pages; its hidden states (None on a pipeline stage before
        the last)."""
        num_seqs = len(lens)
        per_seq = [-(-n // self.block_size) for n in lens]
        layout = self.model.kv_layout
        state_pages = max((g.state_pages for g in layout.groups), default=0)
        # every KV group uses the same blocks here: layers sharing a slot overwrite each
        # other's pages, after each has read its own (one prefill, no context before it)
        pages = scratch(max(sum(per_seq), state_pages))
        first = [sum(per_seq[:i]) for i in range(num_seqs)]
        block_ids = [list(range(f, f + n)) for f, n in zip(first, per_seq)]
        metadata = AttentionMetadata.build(lens, lens, block_ids, self.block_size, self.device)
        if state_pages:  # recurrent groups: every sequence fresh, on one scratch slot
            slot = list(range(state_pages))
            states = RecurrentStateMetadata([slot] * num_seqs, [None] * num_seqs, [[] for _ in lens])
            linear = recurrent_metadata(lens, lens, states, self.block_size, self.device)
            metadata = [linear if g.kind == AttentionKind.LINEAR else metadata for g in layout.groups]
        for backend in self.backends:
            for m in metadata if isinstance(metadata, list) else [metadata]:
                if (backend.kind == AttentionKind.LINEAR) == (m.recurrent is not None):
                    backend.prepare(m)
        _, positions = token_positions(lens, lens)
        caches = list(pages.layer_caches[:len(self.model.attention_specs)])  # not the draft's
        return self.model(input_ids, positions.to(self.device), caches, metadata)

    def sleep(self, level: int) -> int:
        """Free the weights' buffers through the platform's allocator (kept in host memory
        at level 1, discarded at 2); the bytes freed."""
        assert self.weights_allocator is not None, "sleep without sleep mode"
        return self.weights_allocator.sleep(keep_contents=level == 1)

    def wake_up(self, level: int) -> None:
        """Weights restored (level 1) or read again from the checkpoint (level 2); decode
        graphs, whose addresses moved, are captured again."""
        assert self.weights_allocator is not None and self.reload_weights is not None
        self.weights_allocator.wake()
        if level == 2:
            self.model.load_weights(self.reload_weights())
            self.model.prepack()
        if self.decode_graphs is not None:
            self.decode_graphs.capture()

    def shutdown(self) -> None:
        """Drop the page views and graphs; give the weights' buffers back to the platform's
        allocator (sleep mode put them there)."""
        self.kv_caches = []
        self.decode_graphs = None
        buffers = getattr(self.model, "weight_buffers", None)
        if buffers and self.weights_allocator is not None:
            release_weights(buffers, self.weights_allocator)
            self.model.weight_buffers = []

    @torch.inference_mode()
    def execute(self, step: StepDescription) -> StepResult:
        """Run one step. `step.structured`: structured output's token masks for some
        sampling rows, applied to their logits before sampling (so logprobs are of the
        masked distribution)."""
        if not self.kv_caches:
            raise RuntimeError("ModelRunner.execute before bind_kv_cache")
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
        if self.draft is not None:
            aux = getattr(self.model.model, "aux_hidden", [])
            out.draft_token_ids = self.draft.propose(batch, inputs.query_lens, hidden, aux, out)
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
        """One token per sampling row; a row with drafts verifies them (its 1 + k
        positions are consecutive in `sample_indices`) and may emit several."""
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
        offsets, pos = [], 0
        for r in sample_rows:
            offsets.append(pos)
            pos += 1 + len(r.draft_token_ids)
        if step.structured is not None:
            self._apply_masks(logits, rows, offsets, step.structured)
        plain = [i for i, r in enumerate(sample_rows) if not r.draft_token_ids]
        if plain:
            plain_logits = logits if len(plain) == len(rows) else logits[[offsets[i] for i in plain]]
            sampled = self.sampler(plain_logits, [rows[i] for i in plain])
            for i, token_id, lp in zip(plain, sampled.token_ids, sampled.logprobs):
                rid = sample_rows[i].state.request_id
                out.sampled_token_ids[rid] = token_id
                if lp is not None:
                    out.logprobs[rid] = lp
        spec = [i for i, r in enumerate(sample_rows) if r.draft_token_ids]
        if spec:
            verified = verify(logits, [
                VerifyRow(rows[i].params, rows[i].prompt_token_ids, rows[i].output_token_ids,
                          rows[i].generator, sample_rows[i].draft_token_ids, offsets[i])
                for i in spec
            ])
            for i, v in zip(spec, verified, strict=True):
                rid = sample_rows[i].state.request_id
                out.accepted_token_ids[rid] = v.token_ids[:-1]
                out.sampled_token_ids[rid] = v.token_ids[-1]
                if v.logprobs is not None:
                    out.accepted_logprobs[rid] = v.logprobs[:-1]
                    out.logprobs[rid] = v.logprobs[-1]

    def _apply_masks(
        self, logits: torch.Tensor, rows: list[SamplingRow], offsets: list[int],
        masks: StructuredMasks,
    ) -> None:
        """`masks.row_indices` index sampling positions (`offsets[i]`: row i's first)."""
        words = np.frombuffer(masks.bitmask, dtype="<i4").reshape(-1, masks.num_words)
        self.apply_token_bitmask(
            logits,
            torch.from_numpy(words.copy()).to(logits.device),
            torch.tensor(masks.row_indices, dtype=torch.int64, device=logits.device),
        )
        row_of = {o: i for i, o in enumerate(offsets)}
        for p in masks.ended_rows:
            # a complete constraint allows only EOS: it wins over min_tokens, which would
            # otherwise mask EOS too and leave nothing to sample (the engine sends no
            # drafts past a complete constraint, so p is a row's first position)
            i = row_of[p]
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
            token_ids.extend(row.token_ids())
            query_lens.append(n)
            seq_lens.append(start + n)
            if row.sample:
                sample_rows.append(row)
                k = len(row.draft_token_ids)  # drafts: their 1 + k positions all sample
                sample_indices.extend(range(offset + n - 1 - k, offset + n))
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
    # int64 [sampling positions]: each sampling row's last token's index, or with k drafts
    # its last 1 + k tokens' indices
    sample_indices: torch.Tensor
    # request id -> (token indices, prompt positions [lo, hi)) for prompt logprobs
    prompt_logprob_rows: dict[str, tuple[torch.Tensor, tuple[int, int]]]
