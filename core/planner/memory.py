"""What fits on one rank: its share of the weights, the activations of the largest step,
and the KV cache left for sessions, sized as the engine's arena sizes it.

KV bytes per sequence come from the arena's own layout (`tokenmill.kv.groups.plan_groups`)
over the rank's attention specs (the family's `attention_specs_for` on the rank's
`local_config`: KV heads split by tensor parallel, replicated below one per rank, MLA's
latent whole on every rank, recurrent states by head): full attention and MLA take a block
per `block_size` tokens, a sliding window at most its window's blocks plus one, a recurrent
group its state's pages plus two checkpoints (the prompt end and the rolling one).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from tokenmill.planner.collectives import cdiv, stage_layers
from tokenmill.planner.mixes import Mix
from tokenmill.planner.model_shape import (
    ROUTERS,
    ModelShape,
    Split,
    expert_params,
)

BLOCK_SIZE = 16
CHECKPOINTS_PER_SEQUENCE = 2  # a recurrent group's prompt-end and rolling checkpoints


@dataclass(frozen=True, slots=True)
class RankMemory:
    total: float  # the rank's memory share the engine may use
    weights: float
    activations: float
    kv: float  # what is left for the KV cache

    @property
    def fits(self) -> bool:
        return self.kv > 0


def weight_bytes_per_rank(model: ModelShape, mix: Mix, stage: int) -> float:
    """Bytes of the weights a rank of `stage` holds (tp splits projections, experts and the
    vocabulary; dcp and pcp ranks hold whole copies of the tp share)."""
    t, b = mix.tp, model.dtype_bytes
    total = 0.0
    for i in stage_layers(model, mix.pp, stage):
        layer = model.layers[i]
        total += layer.other_params * b
        for lin in layer.linears:
            per = b if lin.name in ROUTERS else model.linear_bytes
            share = lin.num_params if lin.split == Split.NONE else cdiv(lin.num_params, t)
            total += share * per
        if layer.experts is not None:
            total += cdiv(layer.experts.num_experts * expert_params(layer.experts, model.hidden), t) * (
                model.expert_bytes)
    table = cdiv(model.vocab, t) * model.hidden * b
    if stage == 0:
        total += table
    if stage == mix.pp - 1:
        total += model.hidden * b + (table if not model.tied or mix.pp > 1 else 0)
    return total


def activation_bytes(model: ModelShape, mix: Mix, max_tokens: int, max_seqs: int) -> float:
    """The engine's profiling step (`max_tokens` tokens over `max_seqs` sequences), about:
    a dozen hidden-sized rows per token live at once (residual, norm output, q/k/v,
    attention output, MLP input and intermediate) and float32 logits per sequence."""
    b = model.dtype_bytes
    widest = max(max((lin.out_features for lin in layer.linears), default=0)
                 for layer in model.layers)
    per_token = (12 * model.hidden + 3 * cdiv(widest, mix.tp)) * b
    return max_tokens * per_token + max_seqs * cdiv(model.vocab, mix.tp) * 4


@lru_cache(maxsize=1024)
def _rank_layout(model: ModelShape, tp: int, ep: bool, pp: int, stage: int):
    from tokenmill.kv.groups import plan_groups
    from tokenmill.model.registry import attention_specs_for, family_for

    config = model.hf_config
    if tp > 1:
        config = family_for(config).local_config(config, tp, expert_parallel=ep)
    dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}[model.dtype_bytes]
    specs = attention_specs_for(config, dtype, BLOCK_SIZE)
    layers = stage_layers(model, pp, stage)
    return plan_groups([specs[i] for i in layers])


def kv_bytes_per_sequence(model: ModelShape, mix: Mix, context: int, stage: int = 0) -> float:
    """KV cache bytes one sequence of `context` tokens takes on a rank of `stage`."""
    from tokenmill.platforms.interfaces import AttentionKind

    layout = _rank_layout(model, mix.tp, mix.ep, mix.pp, stage)
    block_bytes = layout.page_bytes * layout.num_slots
    blocks = 0
    full = cdiv(context, BLOCK_SIZE)
    for group in layout.groups:
        if group.kind == AttentionKind.LINEAR:
            blocks += group.state_pages * (1 + CHECKPOINTS_PER_SEQUENCE)
        elif group.kind == AttentionKind.SLIDING_WINDOW:
            blocks += min(full, cdiv(group.sliding_window, BLOCK_SIZE) + 1)
        else:
            blocks += full
    return blocks * block_bytes / mix.dcp  # dcp spreads each sequence's tokens


def rank_memory(model: ModelShape, mix: Mix, memory_bytes: float, max_tokens: int,
                max_seqs: int, utilization: float = 0.9) -> RankMemory:
    """The worst stage's budget: `utilization` of `memory_bytes` (one rank's memory)."""
    total = utilization * memory_bytes
    worst = None
    for stage in range(mix.pp):
        weights = weight_bytes_per_rank(model, mix, stage)
        acts = activation_bytes(model, mix, max_tokens, max_seqs)
        entry = RankMemory(total, weights, acts, total - weights - acts)
        if worst is None or entry.kv < worst.kv:
            worst = entry
    assert worst is not None
    return worst


def sessions_that_fit(model: ModelShape, mix: Mix, memory: RankMemory, context: int) -> int:
    """Sequences of `context` tokens the KV cache of every stage holds at once (per replica)."""
    if not memory.fits:
        return 0
    per = max(kv_bytes_per_sequence(model, mix, context, s) for s in range(mix.pp))
    return int(memory.kv // per) if per > 0 else 10**9
