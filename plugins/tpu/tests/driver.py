"""A minimal engine loop for the runner tests: step descriptions built by hand.

Each request is prefilled in chunks of at most `chunk` tokens (mixed with the other
requests' decodes in the same step), then decoded one token per step; blocks are handed
out from a shuffled pool, so a runner that reads a wrong block gets wrong tokens.
"""

from __future__ import annotations

import random

from tokenmill.platforms.step import CachedRequest, NewRequest, SamplingSpec, StepDescription


def generate(
    runner,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    chunk: int = 1 << 30,
    block_size: int = 16,
    num_blocks: int = 64,
    sampling: SamplingSpec | None = None,
    seeds: list[int | None] | None = None,
    first_id: int = 0,
) -> list[list[int]]:
    """Run every prompt to `max_tokens` outputs; returns the output token ids per prompt."""
    sampling = sampling or SamplingSpec(temperature=0.0)
    seeds = seeds or [None] * len(prompts)
    pool = list(range(1, num_blocks))
    random.Random(0).shuffle(pool)
    ids = [str(first_id + i) for i in range(len(prompts))]
    blocks: dict[str, list[int]] = {rid: [] for rid in ids}
    computed = dict.fromkeys(ids, 0)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    sent: set[str] = set()
    pending: dict[str, list[int]] = {rid: [] for rid in ids}  # outputs not yet sent
    step_id = 0
    while any(len(outputs[r]) < max_tokens for r in ids):
        new, cached, scheduled, counts = [], [], [], []
        for rid, prompt in zip(ids, prompts):
            if len(outputs[rid]) >= max_tokens:
                continue
            total = len(prompt) + len(outputs[rid])
            n = min(chunk, total - computed[rid])
            before = len(blocks[rid])
            while len(blocks[rid]) * block_size < computed[rid] + n:
                blocks[rid].append(pool.pop())
            if rid not in sent:
                new.append(NewRequest(rid, prompt, [], sampling, seeds[ids.index(rid)],
                                      list(blocks[rid]), computed[rid]))
                sent.add(rid)
            else:
                cached.append(CachedRequest(rid, pending[rid], blocks[rid][before:],
                                            computed[rid]))
                pending[rid] = []
            scheduled.append(rid)
            counts.append(n)
        step = StepDescription(step_id=step_id, new_requests=new, cached_requests=cached,
                               scheduled_request_ids=scheduled, num_scheduled_tokens=counts)
        result = runner.execute(step)
        step_id += 1
        for rid, n in zip(scheduled, counts):
            computed[rid] += n
            if rid in result.sampled_token_ids:
                token = result.sampled_token_ids[rid]
                outputs[rid].append(token)
                pending[rid].append(token)
    runner.execute(StepDescription(step_id=step_id, finished_request_ids=ids))
    return [outputs[r] for r in ids]
