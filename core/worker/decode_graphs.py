"""Decode steps through the platform's graph capture (`tokenmill_graph_capture`).

Static input buffers sized for the largest bucket; one `AttentionMetadata` per bucket
whose device tensors are views of them. A decode-only step of n requests is written into
the buffers in place and padded to the smallest bucket >= n with rows that compute one
token at position 0 into a scratch block no request owns; then the platform replays the
forward it captured for that bucket.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.platforms.interfaces import AttentionMetadata, GraphCapture
from tokenmill.platforms.kit.runner_state import ScheduledRow

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(
        self,
        graphs: GraphCapture,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        backends: list,
        *,
        scratch_block: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.graphs = graphs
        self.model = model
        self.kv_caches = kv_caches
        self.backends = backends
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.buckets = graphs.batch_sizes(max_num_seqs)
        self.num_replays = 0  # decode steps that ran through a captured graph
        size = self.buckets[-1]
        width = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((size, width), dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(size, dtype=torch.int64, device=device)
        self.metadata = {b: self._metadata(b) for b in self.buckets}

    def _metadata(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=b,
            num_seqs=b,
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            query_lens_cpu=[1] * b,
            seq_lens_cpu=[1] * b,
            max_query_len=1,
            max_seq_len=1,
            block_size=self.block_size,
        )

    def capture(self) -> None:
        """Capture every bucket, largest first (as CUDA graph pools prefer), over padding."""
        for b in reversed(self.buckets):
            self._fill([], b)
            self.graphs.capture(b, self._forward_fn(b))
        logger.info("captured decode graphs for batch sizes %s", self.buckets)

    def _forward_fn(self, b: int):
        ids, positions, metadata = self.input_ids[:b], self.positions[:b], self.metadata[b]
        model, kv_caches = self.model, self.kv_caches

        def forward() -> torch.Tensor:
            return model(ids, positions, kv_caches, metadata)

        return forward

    def bucket_for(self, batch: list[ScheduledRow]) -> int | None:
        """The bucket of a decode-only batch; None when the step must run eagerly."""
        if any(row.num_tokens != 1 for row in batch):
            return None
        return next((b for b in self.buckets if b >= len(batch)), None)

    def run(self, batch: list[ScheduledRow], bucket: int) -> torch.Tensor:
        """Hidden states [len(batch), hidden] of a decode-only batch, by graph replay."""
        self._fill(batch, bucket)
        for backend in self.backends:
            backend.prepare(self.metadata[bucket])
        hidden = self.graphs.replay(bucket)
        self.num_replays += 1
        return hidden[: len(batch)]

    def _fill(self, batch: list[ScheduledRow], bucket: int) -> None:
        """Write the batch into the static buffers, padding rows after it."""
        n, bs = len(batch), self.block_size
        ids = [row.state.token_ids(row.start, row.start + 1)[0] for row in batch]
        positions = [row.start for row in batch]
        slots = [row.state.block_ids[p // bs] * bs + p % bs for row, p in zip(batch, positions)]
        pad = bucket - n
        self.input_ids[:bucket].copy_(torch.tensor(ids + [0] * pad, dtype=torch.int64))
        self.positions[:bucket].copy_(torch.tensor(positions + [0] * pad, dtype=torch.int64))
        self.slot_mapping[:bucket].copy_(
            torch.tensor(slots + [self.scratch_block * bs] * pad, dtype=torch.int64)
        )
        seq_lens = [p + 1 for p in positions] + [1] * pad
        self.seq_lens[:bucket].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        tables = torch.zeros((bucket, self.block_tables.shape[1]), dtype=torch.int32)
        for i, row in enumerate(batch):
            used = row.state.block_ids[: positions[i] // bs + 1]
            tables[i, : len(used)] = torch.tensor(used, dtype=torch.int32)
        tables[n:, 0] = self.scratch_block
        self.block_tables[:bucket].copy_(tables)
        metadata = self.metadata[bucket]
        metadata.seq_lens_cpu = seq_lens
        metadata.max_seq_len = max(seq_lens)
        metadata.backend_state = {}
