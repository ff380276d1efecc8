"""The fraction of the roofline a running engine gets: per step, the FLOPs and bytes the
performance model counts for the step's batch, over the step's wall time, against the
active platform's `HardwareSpec` (its `tokenmill_hardware_spec`) times the engine's ranks.
The engine feeds it each step; /metrics shows the gauges (docs/server.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.planner.mixes import Mix
from tokenmill.planner.model_shape import ModelShape
from tokenmill.planner.ops import Seq
from tokenmill.platforms.interfaces import HardwareSpec

logger = logging.getLogger(__name__)
ROUND = 64  # tokens of context the step costs are rounded to
MEMO_ENTRIES = 4096


def _round(tokens: int) -> int:
    return (tokens + ROUND // 2) // ROUND * ROUND


@dataclass(frozen=True, slots=True)
class RooflineStats:
    flops_per_s: float = 0.0  # model FLOP/s of the last step, every rank together
    flops_utilization: float = 0.0  # of peak FLOP/s (at the model dtype) x ranks
    bytes_per_s: float = 0.0  # bytes/s the step must move at least
    bandwidth_utilization: float = 0.0  # of memory bandwidth x ranks
    flops_total: float = 0.0  # since start
    bytes_total: float = 0.0


class RooflineMeter:
    """Counts each step's model FLOPs and bytes (`tokenmill.planner.step.stage_costs`, on
    every rank of the engine) and keeps the last step's utilisation."""

    def __init__(self, model: ModelShape, mix: Mix, spec: HardwareSpec, dtype: torch.dtype,
                 shared_host: bool) -> None:
        self.model, self.mix = model, mix
        name = str(dtype).removeprefix("torch.")
        devices = 1 if shared_host else mix.world  # a shared host's ranks split one spec
        self.peak = (spec.peak_flops.get(name) or max(spec.peak_flops.values())) * devices
        self.bandwidth = spec.memory_bandwidth * devices
        self.stats = RooflineStats()
        self._memo: dict[tuple, tuple[float, float]] = {}

    @classmethod
    def for_engine(cls, hf_config: Any, dtype: torch.dtype, args: Any, spec: HardwareSpec,
                   device_type: str) -> RooflineMeter | None:
        """The meter of an engine, or None (logged) for a model the planner cannot read."""
        from tokenmill.planner.catalog import shape_of

        try:
            model = shape_of(hf_config, getattr(hf_config, "model_type", "model"), dtype)
        except (AttributeError, KeyError, ValueError) as exc:
            logger.warning("no roofline gauges: the planner cannot read this model (%s)", exc)
            return None
        mix = Mix(tp=args.tensor_parallel_size, pp=args.pipeline_parallel_size,
                  ep=bool(args.enable_expert_parallel), sp=bool(args.enable_sequence_parallelism),
                  pcp=args.prefill_context_parallel_size, dcp=args.decode_context_parallel_size)
        return cls(model, mix, spec, dtype, device_type == "cpu")

    def step_cost(self, rows: list[tuple[int, int]], sampled: int) -> tuple[float, float]:
        """(FLOPs, bytes) of a step of (tokens already cached, tokens computed) rows, over
        every rank: decode rows counted as one batch at their mean context. Contexts are
        rounded to `ROUND` tokens and the results kept, so a steady stream of decode steps
        costs a dictionary lookup (a few percent of error at most, on short contexts)."""
        decodes = [cached for cached, new in rows if new == 1 and cached > 0]
        seqs = [Seq(_round(cached), new) for cached, new in rows if not (new == 1 and cached > 0)]
        if decodes:
            seqs.append(Seq(max(_round(sum(decodes) // len(decodes)), 1), 1, len(decodes)))
        key = (tuple(sorted(seqs, key=lambda s: (s.cached, s.new, s.count))), sampled)
        if key not in self._memo:
            if len(self._memo) > MEMO_ENTRIES:
                self._memo.clear()
            self._memo[key] = self._cost(list(key[0]), sampled)
        return self._memo[key]

    def _cost(self, seqs: list[Seq], sampled: int) -> tuple[float, float]:
        from tokenmill.planner.step import stage_costs

        ranks = self.mix.tp * self.mix.pcp * self.mix.dcp
        flops = moved = 0.0
        for stage in range(self.mix.pp):
            for cost in stage_costs(self.model, self.mix, tuple(seqs), sampled, stage):
                flops += cost.flops * ranks
                moved += cost.bytes * ranks
        return flops, moved

    def observe(self, rows: list[tuple[int, int]], sampled: int, seconds: float) -> None:
        if not rows or seconds <= 0:
            return
        flops, moved = self.step_cost(rows, sampled)
        s = self.stats
        self.stats = RooflineStats(flops / seconds, flops / seconds / self.peak, moved / seconds,
                                   moved / seconds / self.bandwidth, s.flops_total + flops,
                                   s.bytes_total + moved)
