"""The shared KV pool against static per-type splits on a moving mixed workload, and
eviction by benefit per byte against LRU.

    python benchmarks/bench_kv_rebalance.py [--pool-gib 8] [--splits 0.2 0.3 ... 0.8]
        [--model gemma3|qwen3_next] [--phases short long mixed agent]

Runs the real scheduler and KV manager (no model: each step's sampled rows get a dummy
token) on Gemma 3 27B's layer layout (bf16, blocks of 16: 5 full-attention groups and 26
sliding-window groups of 2 layers, window 1,024) through three phases that change the
batch size and the context length: many short requests, a few long ones, then a mix.
The shared pool (one free list, every group draws what it needs) is compared with static
splits that give a fixed fraction of the blocks to the full-attention groups and the rest
to the windows (evenly within each type), swept over `--splits`. Per phase: the most
sequences running at once, steps to finish the phase (each step schedules at most 2,048
tokens, so fewer steps is more throughput), preemptions and the prefix-cache hit rate.

A fourth phase, agents, reuses prefixes: 16 sessions at once, each of 4 turns whose
prompt is the previous turn's prompt and output plus a new tool result (200-1,500
tokens), after a 1,000-3,000-token start; after turn 1 and 3 the same prompt is sampled
again (a retry), after turn 2 the last tool result is replaced (an edit: the history up to
it again, another result). Every arena runs with `eviction="benefit"` (the default) and
the shared pool also with "lru".

Then the KV bytes a 12-token and a 2,000-token request hold while decoding, from the
shared pool, next to vLLM's page-unification rule computed for the same layout.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from dataclasses import dataclass

import torch
from transformers import Gemma3TextConfig

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.kv.arena import KVArena
from tokenmill.kv.block_pool import BlockPool
from tokenmill.kv.eviction import RecomputeCost
from tokenmill.kv.groups import plan_groups
from tokenmill.kv.manager import KVCacheManager, PrefixHit
from tokenmill.model.base import attention_specs
from tokenmill.platforms.interfaces import AttentionKind
from tokenmill.sampling_params import SamplingParams

BLOCK = 16
GIB = 1 << 30
PHASE_NAMES = {
    "short": "short (96 x 12-400 tok)",
    "long": "long (6 x 8k-24k tok)",
    "mixed": "mixed (48 short + 3 long)",
    "agent": "agents (16 x 4 turns + 3)",
}


class StaticSplitKV(KVCacheManager):
    """The baseline: every group has a pool of its own, of a fixed size."""

    def __init__(self, shares: list[int], block_size: int, groups, **kw) -> None:
        super().__init__(sum(shares), block_size, True, groups, **kw)
        for alloc, share, group in zip(self.allocators, shares, groups, strict=True):
            windowed = group.kind == AttentionKind.SLIDING_WINDOW
            alloc.pool = BlockPool(share + windowed, True, reserve_null=windowed,
                                   eviction=self.pool.eviction)

    @property
    def usage(self) -> float:
        return max(a.pool.usage for a in self.allocators)

    def allocate_slots(self, request: Request, num_new_tokens: int, hits: PrefixHit | None = None) -> bool:
        num_hit = hits.num_tokens if hits is not None else 0
        num_computed = request.num_computed_tokens + num_hit
        total = num_computed + num_new_tokens
        tables = hits.tables if hits is not None and hits.tables else [[] for _ in self.allocators]
        recurrent = self.recurrent_group_ids
        self.update_block_hashes(request)
        for alloc in self.allocators:
            alloc.release_outside_window(request, num_computed)
        for i, (alloc, table) in enumerate(zip(self.allocators, tables, strict=True)):
            free_hits = sum(1 for b in table if b.ref_cnt == 0 and b.block_id)
            extra = (num_computed,) if i in recurrent else ()
            need = alloc.num_blocks_needed(request, total, table, *extra)
            if need + free_hits > alloc.pool.num_free_blocks:
                return False
        for alloc, table in zip(self.allocators, tables, strict=True):
            alloc.take_hits(request, table)
        for i, alloc in enumerate(self.allocators):
            alloc.allocate(request, total, *((num_computed,) if i in recurrent else ()))
        self.update_block_hashes(request)
        for alloc in self.allocators:
            alloc.cache_full_blocks(request, total)
        self._score_published(request, num_computed, total)
        return True


@dataclass
class PhaseResult:
    max_running: int = 0
    steps: int = 0
    preemptions: int = 0
    hit_rate: float = 0.0  # prompt tokens found in the prefix cache / looked up


OUT = 64  # output tokens of every request; the driver samples token 1 each time
# A phase is a list of sessions; a session's requests (prompt token ids) run one after
# the other, each submitted when the previous finishes; the sessions run at once.
Phase = list[list[list[int]]]


class _Tokens:
    """Distinct token ids: no two calls share a prefix."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, count: int) -> list[int]:
        self.n += 1
        return [(self.n * 7919 + i) % 50000 + 2 for i in range(count)]


def phases(seed: int = 0) -> dict[str, Phase]:
    """The phases by name: plain ones are sessions of one request each."""
    rng, fresh = random.Random(seed), _Tokens()
    short = [[fresh(rng.randint(12, 400))] for _ in range(96)]
    long = [[fresh(rng.randint(8000, 24000))] for _ in range(6)]
    mixed = [[fresh(rng.randint(12, 400))] for _ in range(48)] + [
        [fresh(rng.randint(8000, 24000))] for _ in range(3)
    ]
    rng.shuffle(mixed)
    return {"short": short, "long": long, "mixed": mixed, "agent": agent_sessions(rng, fresh)}


def agent_sessions(rng: random.Random, fresh: _Tokens, num_sessions: int = 16,
                   turns: int = 4) -> Phase:
    """Agent sessions: turn i's prompt is turn i-1's prompt, its output and a new tool
    result; a retry (the same prompt again) after turns 1 and 3, an edit (the history up
    to the last tool result, then another one) after turn 2."""
    sessions = []
    for _ in range(num_sessions):
        history, items = fresh(rng.randint(1000, 3000)), []
        for turn in range(1, turns + 1):
            prompt = history + fresh(rng.randint(200, 1500))
            items.append(prompt)
            if turn % 2:
                items.append(prompt)
            elif turn == 2:
                items.append(history + fresh(rng.randint(200, 1500)))
            history = prompt + [1] * OUT
        sessions.append(items)
    return sessions


def run(kv: KVCacheManager, workload: list[Phase]) -> list[PhaseResult]:
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=32768,
                             long_prefill_token_threshold=512)
    scheduler = Scheduler(config, kv)
    results, ids = [], itertools.count()
    pending: dict[str, list[list[int]]] = {}  # request id -> the rest of its session

    def submit(session: list[list[int]]) -> None:
        rid = f"r{next(ids)}"
        scheduler.add_request(Request(rid, session[0], SamplingParams(max_tokens=OUT)))
        pending[rid] = session[1:]

    for phase in workload:
        result, before = PhaseResult(), scheduler.num_preemptions
        queries, hits = kv.stats.queries, kv.stats.hits
        for session in phase:
            submit(session)
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            if plan.is_empty:
                raise RuntimeError("the pool cannot hold one request of this workload")
            result.steps += 1
            result.max_running = max(result.max_running, scheduler.num_running)
            scheduler.update_computed(plan)
            for s in plan.scheduled:
                if not s.sample:
                    continue
                request = scheduler.requests[s.request_id]
                request.append_output_token(1)
                if request.num_output_tokens >= OUT:
                    scheduler.finish(s.request_id, RequestStatus.FINISHED_LENGTH)
                    rest = pending.pop(s.request_id)
                    if rest:
                        submit(rest)
        result.preemptions = scheduler.num_preemptions - before
        looked_up = kv.stats.queries - queries
        result.hit_rate = (kv.stats.hits - hits) / looked_up if looked_up else 0.0
        results.append(result)
    return results


def _layout(model: str = "gemma3"):
    """(the KV layout, bytes of one page, the recompute cost of the model's layers)."""
    if model == "qwen3_next":
        from transformers import Qwen3NextConfig

        from tokenmill.model.registry import attention_specs_for

        specs = attention_specs_for(Qwen3NextConfig(), torch.bfloat16, BLOCK)
        layout = plan_groups(specs)
        return layout, layout.page_bytes, RecomputeCost.from_specs(specs)
    config = Gemma3TextConfig(
        hidden_size=5376, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
        head_dim=128, sliding_window=1024, max_position_embeddings=131072,
    )
    specs = attention_specs(config, torch.bfloat16, BLOCK)
    layout = plan_groups(specs)
    page = KVArena.page_bytes_for(specs[0])
    return layout, page, RecomputeCost.from_specs(specs)


def static_shares(layout, num_blocks: int, full_fraction: float) -> list[int]:
    full = [g for g in layout.groups if g.kind == AttentionKind.FULL]
    windows = [g for g in layout.groups if g.kind != AttentionKind.FULL]
    per_full = int(num_blocks * full_fraction) // len(full)
    per_window = (num_blocks - per_full * len(full)) // len(windows)
    return [per_full if g.kind == AttentionKind.FULL else per_window for g in layout.groups]


def request_cost(kv_factory, prompt: int, block_bytes: int) -> int:
    kv = kv_factory()
    request = Request("r", list(range(prompt)), SamplingParams(max_tokens=2))
    while request.num_computed_tokens < prompt:
        n = min(512, prompt - request.num_computed_tokens)
        assert kv.allocate_slots(request, n)
        request.num_computed_tokens += n
    request.append_output_token(0)
    assert kv.allocate_slots(request, 1)
    return sum(kv.num_blocks_held(request)) * block_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool-gib", type=float, default=8.0)
    parser.add_argument("--model", choices=["gemma3", "qwen3_next"], default="gemma3",
                        help="the layer layout: Gemma 3 27B, or Qwen3-Next-80B-A3B (36 Gated "
                        "DeltaNet layers with float32 state, 12 full attention)")
    parser.add_argument("--splits", type=float, nargs="+",
                        default=[0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    parser.add_argument("--phases", nargs="+", choices=list(PHASE_NAMES),
                        default=list(PHASE_NAMES))
    args = parser.parse_args()
    layout, page, cost = _layout(args.model)
    block_bytes = layout.num_slots * page
    num_blocks = int(args.pool_gib * GIB) // block_bytes
    every = phases()
    workload = [every[p] for p in args.phases]
    names = [PHASE_NAMES[p] for p in args.phases]
    started = time.perf_counter()
    rows = {}
    for eviction in ("benefit", "lru"):
        kv = KVCacheManager(num_blocks + 1, BLOCK, True, layout.groups, eviction=eviction,
                            recompute_cost=cost)
        rows[f"shared pool, {eviction}"] = run(kv, workload)
    for f in args.splits:
        kv = StaticSplitKV(static_shares(layout, num_blocks, f), BLOCK, layout.groups,
                           recompute_cost=cost)
        try:
            rows[f"static {f:.0%} full, benefit"] = run(kv, workload)
        except RuntimeError:
            rows[f"static {f:.0%} full, benefit"] = None  # a long request does not fit
    title = {"gemma3": "Gemma 3 27B", "qwen3_next": "Qwen3-Next-80B-A3B"}[args.model]
    print(f"{title} layout, {args.pool_gib:g} GiB pool = {num_blocks} blocks of "
          f"{block_bytes // 1024} KiB ({len(layout.groups)} groups); "
          f"{time.perf_counter() - started:.0f} s\n")
    print("| arena, eviction | " + " | ".join(
        f"{n}: max running / steps / preemptions / hit %" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for name, results in rows.items():
        cells = ["cannot hold a long request"] * len(names) if results is None else [
            f"{r.max_running} / {r.steps} / {r.preemptions} / {100 * r.hit_rate:.0f}"
            for r in results
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")

    print("\n| request | tokenmill shared pool | vLLM page unification (same layout) |")
    print("|---|---:|---:|")
    for prompt in (12, 2000):
        ours = request_cost(lambda: KVCacheManager(4096, BLOCK, True, layout.groups), prompt, block_bytes)
        print(f"| {prompt:,} tokens | {ours / 1024:,.0f} KiB | {vllm_cost(layout, page, prompt) / 1024:,.0f} KiB |")
    if args.model == "qwen3_next":
        return
    print("\nQwen3-Next-80B-A3B (36 Gated DeltaNet + 12 attention layers, bf16 state), arithmetic:")
    print("| request | vLLM page unification | byte-exact (blocks of 16, one state per layer) |")
    print("|---|---:|---:|")
    for prompt in (12, 2000):
        vllm, exact = qwen3_next_costs(prompt)
        print(f"| {prompt:,} tokens | {vllm / 2**20:.1f} MiB | {exact / 2**20:.1f} MiB |")


def vllm_cost(layout, page: int, prompt: int) -> int:
    """vLLM's hybrid allocator: every layer's page is unified to the largest page (here all
    attention pages are equal, so block_size stays 16), one block table per group, the
    window's blocks outside it freed: the same count of blocks as ours. With recurrent
    groups the attention block grows until one layer's page holds a state, and each
    recurrent layer holds one such page."""
    total = 0
    tokens = prompt + 1
    states = [g.state.num_bytes for g in layout.groups if g.state is not None]
    if states:
        per_token = page // BLOCK
        block = BLOCK * -(-max(states) // (BLOCK * per_token))
        for g in layout.groups:
            blocks = 1 if g.state is not None else -(-tokens // block)
            total += blocks * len(g.layers) * block * per_token
        return total
    for g in layout.groups:
        blocks = -(-tokens // BLOCK)
        if g.sliding_window is not None:
            blocks = min(blocks, -(-(g.sliding_window - 1 + 1) // BLOCK) + 1)
        total += blocks * len(g.layers) * page
    return total


def qwen3_next_costs(prompt: int) -> tuple[int, int]:
    """(vLLM, byte-exact) bytes of one request on Qwen3-Next-80B-A3B's layout.

    vLLM grows the attention block until one layer's page holds a Gated DeltaNet state
    (block_size = 16 * ceil(state / (16 * per-token page))) and pads each state to that
    page; byte-exact keeps blocks of 16 and one state per linear layer."""
    from transformers import Qwen3NextConfig

    c = Qwen3NextConfig()
    num_attn = c.layer_types.count("full_attention")
    num_linear = c.layer_types.count("linear_attention")
    per_token = 2 * c.num_key_value_heads * c.head_dim * 2  # K and V, bf16, one layer
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + (
        c.linear_num_value_heads * c.linear_value_head_dim
    )
    state = conv_dim * (c.linear_conv_kernel_dim - 1) * 2 + (
        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 2
    )
    block = 16 * -(-state // (16 * per_token))
    tokens = prompt + 1
    vllm = (num_attn * -(-tokens // block) + num_linear) * block * per_token
    exact = num_attn * -(-tokens // 16) * 16 * per_token + num_linear * state
    return vllm, exact


if __name__ == "__main__":
    sys.exit(main())
