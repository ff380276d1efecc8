"""Load or recompute: the per-request cost model of the KV connector's scheduler side.

A tier hit is worth loading when the load brings the KV back sooner than the forward pass
would compute it. Per block position the load costs the bytes of its objects over the
bandwidth of the tier each comes from; the recompute costs the block's tokens at the
engine's prefill rate. Both are measured as the engine runs (`observe_load`: a load job's
bytes and seconds per tier; `observe_step`: a step's tokens and forward seconds, from
steps of at least `MIN_STEP_TOKENS`, where prefill dominates), as exponentially weighted
means; until a step is measured every hit is loaded.

`blocks_to_load(costs)` picks how many leading blocks of the hit to load: the k that
minimises load(blocks < k) + recompute(blocks >= k), so a hit whose tail lies only on a
slow tier loads its head and recomputes the tail, and a model whose compute is cheaper
than its bytes (a small model on a fast accelerator behind a slow link) recomputes
everything. Either way the output is the same: only where the KV comes from changes.
The scheduler side counts the tokens it chose to recompute per tier
(`TierStats.tokens_recompute_chosen`, in /metrics).

For scale (docs/kv-offload.md): SmolLM2-135M holds 23 KB of KV per token for ~0.27 GFLOP
of forward pass; Llama-3-70B 320 KB for ~140 GFLOP. On this 2-core CPU a 16-token block
of SmolLM2 takes ~15 ms to compute and ~0.1 ms to load from host memory: load wins by
two orders of magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# bytes/s assumed for a tier before its first load is measured
DEFAULT_BANDWIDTH = {"host": 8e9, "disk": 1e9}
OTHER_BANDWIDTH = 0.25e9  # a remote store before it is measured
MIN_STEP_TOKENS = 64
ALPHA = 0.2  # weight of a new measurement


@dataclass(slots=True)
class LoadCostModel:
    object_bytes: int
    block_size: int
    bandwidth: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BANDWIDTH))
    seconds_per_token: float | None = None  # None: no prefill step measured yet

    def observe_load(self, tier_bytes: dict[str, int], tier_seconds: dict[str, float]) -> None:
        for tier, nbytes in tier_bytes.items():
            seconds = tier_seconds.get(tier, 0.0)
            if nbytes <= 0 or seconds <= 0:
                continue
            rate = nbytes / seconds
            old = self.bandwidth.get(tier)
            self.bandwidth[tier] = rate if old is None else (1 - ALPHA) * old + ALPHA * rate

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < MIN_STEP_TOKENS or seconds <= 0:
            return
        rate = seconds / num_tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else (1 - ALPHA) * old + ALPHA * rate

    def load_seconds(self, tiers: list[str]) -> float:
        """Seconds to load one block position whose objects come from `tiers`."""
        return sum(self.object_bytes / self.bandwidth.get(t, OTHER_BANDWIDTH) for t in tiers)

    def blocks_to_load(self, positions: list[list[str]]) -> int:
        """How many leading block positions to load; `positions[j]`: the tier of each of
        position j's objects, in prefix order."""
        if self.seconds_per_token is None:
            return len(positions)
        recompute = self.seconds_per_token * self.block_size
        best_k, best, total = 0, 0.0, 0.0
        for j, tiers in enumerate(positions):
            total += self.load_seconds(tiers) - recompute
            if total < best:
                best, best_k = total, j + 1
        return best_k
