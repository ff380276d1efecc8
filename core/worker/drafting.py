"""Model-based drafting on the worker (speculative methods `mtp` and `eagle3`): after a
step's verification, the draft model (core/spec_decode/draft_models.py) proposes the
next step's drafts; they go back in `StepResult.draft_token_ids` and return in the next
step description like the engine core's own (docs/speculative.md).

One step's drafting, for the rows of the step:

1. Catch-up pass over every valid position of every row (prompt chunks too, so the
   draft's KV covers the whole context): position p gets the target's hidden state at p
   and the token at p + 1 (the next prompt token; after a verification the accepted
   drafts, then the sampled token). Rejected drafts' positions are left out. The draft's
   KV lives in its own arena slots under the rows' ordinary block tables, so a prefix
   hit, a preemption or the KV tiers carry it with the target's.
2. For each sampling row, its last position's logits give draft 1; k - 1 chained
   one-token passes (the model's own hidden state and draft i) give drafts 2..k, greedily.
   Chained positions lie past the row's known tokens: their KV is scratch, written into
   the row's own blocks past its tokens or into reserved scratch blocks past the pool,
   and the next catch-up pass overwrites every position before any real query reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.platforms.interfaces import AttentionMetadata
from tokenmill.platforms.kit.runner_state import ScheduledRow
from tokenmill.platforms.step import StepResult


@dataclass(slots=True)
class DraftPlan:
    """Where the draft model's KV lives: its layers' caches, its KV group, and the
    reserved scratch blocks chained positions may use past a row's table."""

    kv_caches: list[torch.Tensor]
    group: int
    scratch_base: int
    scratch_per_row: int


def scratch_blocks_per_row(num_speculative_tokens: int, block_size: int) -> int:
    """Blocks a row's k - 1 chained positions may need past its table."""
    return -(-(num_speculative_tokens - 1) // block_size)


class DraftProposer:
    def __init__(self, draft: torch.nn.Module, num_speculative_tokens: int, block_size: int,
                 device: torch.device) -> None:
        self.draft = draft
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.plan: DraftPlan | None = None  # set by the runner with its KV arena

    def _prepare(self, query_lens: list[int], seq_lens: list[int],
                 tables: list[list[int]]) -> AttentionMetadata:
        metadata = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size,
                                           self.device)
        for backend in {id(b): b for b in self.draft.layer_backends}.values():
            backend.prepare(metadata)
        return metadata

    def propose(self, batch: list[ScheduledRow], query_lens: list[int], hidden: torch.Tensor,
                aux: list[torch.Tensor], out: StepResult) -> dict[str, list[int]]:
        """Drafts for every sampling row of the step (request id -> k token ids)."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("DraftProposer.propose before the runner's KV arena exists")
        index, ids, positions, qlens, slens, tables = [], [], [], [], [], []
        sampling: list[tuple[str, int, int, list[int]]] = []  # rid, last index, last pos, table
        offset = 0
        for row, n in zip(batch, query_lens, strict=True):
            state, start = row.state, row.start
            m = n - len(row.draft_token_ids)  # known tokens computed this step
            if row.sample:
                rid = state.request_id
                following = (state.token_ids(start + 1, start + m)
                             + list(out.accepted_token_ids.get(rid, ()))
                             + [out.sampled_token_ids[rid]])
            else:
                following = state.token_ids(start + 1, start + n + 1)
            valid = len(following)
            table = state.tables()[plan.group]
            index.extend(range(offset, offset + valid))
            ids.extend(following)
            positions.extend(range(start, start + valid))
            qlens.append(valid)
            slens.append(start + valid)
            tables.append(table)
            if row.sample:
                sampling.append((state.request_id, len(ids) - 1, start + valid - 1, table))
            offset += n
        dev = self.device
        take = torch.tensor(index, dtype=torch.int64, device=dev)
        first = self.draft.first_hidden(hidden[take], [a[take] for a in aux])
        metadata = self._prepare(qlens, slens, tables)
        logit_hidden, chain_hidden = self.draft(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            first, plan.kv_caches, metadata,
        )
        if not sampling:
            return {}
        last = torch.tensor([s[1] for s in sampling], dtype=torch.int64, device=dev)
        tokens = self.draft.draft_tokens(logit_hidden[last])
        drafts = [tokens]
        chain_hidden = chain_hidden[last]
        last_pos = [s[2] for s in sampling]
        chain_tables = [self._chain_table(i, s[3], s[2]) for i, s in enumerate(sampling)]
        for step in range(1, self.k):
            pos = [p + step for p in last_pos]
            metadata = self._prepare([1] * len(pos), [p + 1 for p in pos], chain_tables)
            logit_hidden, chain_hidden = self.draft(
                tokens, torch.tensor(pos, dtype=torch.int64, device=dev), chain_hidden,
                plan.kv_caches, metadata,
            )
            tokens = self.draft.draft_tokens(logit_hidden)
            drafts.append(tokens)
        stacked = torch.stack(drafts, dim=1).tolist()
        return {s[0]: row for s, row in zip(sampling, stacked, strict=True)}

    def _chain_table(self, i: int, table: list[int], last_pos: int) -> list[int]:
        """Row i's block table covering its chained positions up to last_pos + k - 1:
        its own blocks, then its reserved scratch blocks."""
        plan = self.plan
        needed = (last_pos + self.k - 1) // self.block_size + 1
        if needed <= len(table):
            return table
        extra = needed - len(table)
        if extra > plan.scratch_per_row:
            raise RuntimeError(f"chained drafts need {extra} scratch blocks past the table, "
                               f"{plan.scratch_per_row} are reserved per row")
        base = plan.scratch_base + i * plan.scratch_per_row
        return table + list(range(base, base + extra))
