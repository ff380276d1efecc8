"""Drive a CausalLM by hand, without the scheduler or the model runner.

A test chooses which tokens of which sequences each step computes; the harness owns a paged KV
cache with deliberately scattered block ids, builds the `AttentionMetadata` and block tables for
the step, runs the model and returns each chunk's logits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from tokenmill.platforms.interfaces import AttentionBackend, AttentionMetadata


@dataclass
class Sequence:
    token_ids: list[int]  # the whole sequence, known up front
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys/values are in the cache


def build_metadata(chunks: list[tuple[Sequence, int]], block_size: int) -> AttentionMetadata:
    """Metadata for a step computing the next `n` tokens of each `(sequence, n)`, in order."""
    return AttentionMetadata.build(
        [n for _, n in chunks],
        [seq.num_computed + n for seq, n in chunks],
        [seq.block_ids for seq, _ in chunks],
        block_size,
    )


class PagedHarness:
    """A model, its backend and a paged KV cache of `num_blocks` blocks per layer."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        num_blocks: int = 64,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.backend = backend
        specs = model.attention_specs
        self.block_size = specs[0].block_size
        # each layer's cache in the layout its backend declares (MLA: latent rows)
        self.kv_caches = [
            torch.zeros(b.kv_cache_shape(s, num_blocks), dtype=s.dtype)
            for s, b in zip(specs, model.layer_backends, strict=True)
        ]
        # Hand out blocks in a shuffled order so no sequence's pages are contiguous.
        self.free_block_ids = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free_block_ids)

    def add(self, token_ids: list[int]) -> Sequence:
        num_blocks = -(-len(token_ids) // self.block_size)
        block_ids = [self.free_block_ids.pop() for _ in range(num_blocks)]
        return Sequence(list(token_ids), block_ids)

    @torch.inference_mode()
    def step(self, chunks: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
        """Compute the next `n` tokens of each `(sequence, n)` in one batch.

        Returns each chunk's float32 logits [n, vocab], in the order given.
        """
        for seq, n in chunks:
            if not 0 < n <= len(seq.token_ids) - seq.num_computed:
                raise ValueError(
                    f"chunk of {n} tokens; sequence has {seq.num_computed} of "
                    f"{len(seq.token_ids)} computed"
                )
        metadata = build_metadata(chunks, self.block_size)
        input_ids = torch.tensor(
            [
                t
                for seq, n in chunks
                for t in seq.token_ids[seq.num_computed : seq.num_computed + n]
            ],
            dtype=torch.int64,
        )
        positions = torch.tensor(
            [p for seq, n in chunks for p in range(seq.num_computed, seq.num_computed + n)],
            dtype=torch.int64,
        )
        self.backend.prepare(metadata)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        logits = self.model.compute_logits(hidden)
        for seq, n in chunks:
            seq.num_computed += n
        return list(logits.split(metadata.query_lens_cpu))

    def run(self, schedule: list[list[tuple[Sequence, int]]]) -> dict[int, torch.Tensor]:
        """Run every step of `schedule`; returns id(sequence) -> logits of all its computed tokens."""
        collected: dict[int, list[torch.Tensor]] = {}
        for chunks in schedule:
            for (seq, _), logits in zip(chunks, self.step(chunks), strict=True):
                collected.setdefault(id(seq), []).append(logits)
        return {key: torch.cat(parts) for key, parts in collected.items()}
