"""The time of one engine step on one replica of a mix: every op of every layer cut to one
rank, timed against the device's roofline, plus the step's collectives and host overhead.

A pipeline's step is one micro-batch through its slowest stage (the serving model turns
stages into bubbles and steady-state rounds). Layers of the same shape are costed once and
multiplied (DeepSeek-V3's 58 MoE layers are one shape), which keeps a search over
hundreds of mixes fast.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from tokenmill.planner import ops
from tokenmill.planner.calibration import Calibration
from tokenmill.planner.cluster import Cluster, Link
from tokenmill.planner.collectives import (
    Collective,
    cdiv,
    collective_seconds,
    stage_layers,
    step_collectives,
)
from tokenmill.planner.mixes import Mix
from tokenmill.planner.model_shape import (
    ROUTERS,
    Layer,
    MixerKind,
    ModelShape,
    Split,
)
from tokenmill.planner.ops import OpCost, Seq


@dataclass(frozen=True, slots=True)
class StepTime:
    seconds: float
    compute_s: float  # ops bound by compute
    memory_s: float  # ops bound by memory bandwidth
    link_s: float  # collectives
    overhead_s: float  # host time beyond the kernels
    flops: float  # per rank
    bytes: float  # per rank

    @property
    def binding(self) -> str:
        parts = {"compute": self.compute_s, "memory bandwidth": self.memory_s,
                 "link": self.link_s, "host overhead": self.overhead_s}
        return max(parts, key=parts.__getitem__)


@dataclass(frozen=True, slots=True)
class Share:
    """What one rank gets of its device: peak FLOP/s and bytes/s (a shared host's ranks
    split its cores), and the calibration for that many ranks sharing it."""

    peak: float
    bandwidth: float
    ranks: int


def rank_share(cluster: Cluster, busy_ranks: int, dtype_name: str = "bfloat16") -> Share:
    spec = cluster.device
    peak = spec.peak_flops.get(dtype_name) or max(spec.peak_flops.values())
    if not cluster.shared_host:
        return Share(peak, spec.memory_bandwidth, 1)
    n = max(busy_ranks, 1)
    return Share(peak / n, spec.memory_bandwidth / n, n)


def layer_costs(layer: Layer, model: ModelShape, mix: Mix, seqs: tuple[Seq, ...]) -> list[OpCost]:
    """Every op of `layer` on one rank of `mix` for a step of `seqs`."""
    t, b = mix.tp, model.dtype_bytes
    tokens = sum(s.count * s.new for s in seqs)
    split = mix.pcp > 1 and tokens >= 2 * mix.pcp
    rows = cdiv(tokens, mix.pcp) if split else tokens
    costs = [ops.rms_norm(cdiv(rows, t) if mix.sp else rows, model.hidden, b)
             for _ in range(layer.norms)]
    for lin in layer.linears:
        k, n = lin.in_features, lin.out_features
        if lin.split == Split.COLUMN:
            n = cdiv(n, t)
        elif lin.split == Split.ROW:
            k = cdiv(k, t)
        wb = model.dtype_bytes if lin.name in ROUTERS else model.linear_bytes
        if lin.latent_up:
            costs.append(ops.latent_up(list(seqs), k, n, wb, b))
        else:
            costs.append(ops.gemm(rows, k, n, wb, b))
        if lin.name.endswith("gate_proj"):
            costs.append(ops.gated_activation(rows, n, b))
    costs.append(_mixer_cost(layer, model, mix, seqs, split))
    if layer.experts is not None:
        e = layer.experts
        if mix.ep:
            local, inter, routed = cdiv(e.num_experts, t), e.intermediate, cdiv(rows * e.top_k, t)
        else:
            local, inter, routed = e.num_experts, cdiv(e.intermediate, t), rows * e.top_k
        costs += ops.experts(routed, rows, local, e.num_experts, e.top_k, model.hidden,
                             inter, model.expert_bytes, b)
        costs.append(ops.gated_activation(routed, inter, b))
    return costs


def _mixer_cost(layer: Layer, model: ModelShape, mix: Mix, seqs: tuple[Seq, ...],
                split: bool) -> OpCost:
    m, t, b = layer.mixer, mix.tp, model.dtype_bytes
    heads = cdiv(m.num_heads, t)
    if m.kind in (MixerKind.FULL, MixerKind.SLIDING):
        kv = max(m.num_kv_heads // t, 1)
        cost = ops.attention(list(seqs), heads, kv, m.qk_dim, m.v_dim, b, b, m.window)
    elif m.kind == MixerKind.MLA:
        nope = m.qk_dim - m.rope_dim
        cost = ops.mla_attention(list(seqs), heads, nope, m.rope_dim, m.v_dim, m.kv_lora_rank, b, b)
    else:
        scan = ops.recurrent(list(seqs), heads, m.qk_dim, m.v_dim, b, m.kind.value)
        conv = ops.short_conv(list(seqs), cdiv(m.conv_channels, t), m.conv_kernel, b)
        return OpCost(scan.op, scan.flops + conv.flops, scan.bytes + conv.bytes)
    if mix.dcp > 1:  # each rank attends to its 1 / dcp of every sequence's keys
        return cost.scaled(1 / mix.dcp)
    if split:  # the last of pcp contiguous slices sees the most keys: (2n - 1) / n^2 of them
        n = mix.pcp
        return OpCost(cost.op, cost.flops * (2 * n - 1) / n / n, cost.bytes)
    return cost


def _layer_signature(layer: Layer) -> tuple:
    return (layer.mixer, layer.linears, layer.experts)


@lru_cache(maxsize=4096)
def _stage_costs_cached(model: ModelShape, mix: Mix, seqs: tuple[Seq, ...], sampled: int,
                        stage: int) -> tuple[OpCost, ...]:
    layers = stage_layers(model, mix.pp, stage)
    shapes = Counter(_layer_signature(model.layers[i]) for i in layers)
    first_of = {_layer_signature(model.layers[i]): model.layers[i] for i in reversed(layers)}
    costs: list[OpCost] = []
    for signature, count in shapes.items():
        costs += [c.repeated(count) for c in layer_costs(first_of[signature], model, mix, seqs)]
    tokens = sum(s.count * s.new for s in seqs)
    b = model.dtype_bytes
    if stage == 0:
        costs.append(ops.embedding(tokens, model.hidden, b))
    if stage == mix.pp - 1 and sampled:
        costs.append(ops.rms_norm(sampled, model.hidden, b))
        costs.append(ops.gemm(sampled, model.hidden, cdiv(model.vocab, mix.tp), b, b))
    return tuple(costs)


def stage_costs(model: ModelShape, mix: Mix, seqs: tuple[Seq, ...], sampled: int,
                stage: int = 0) -> list[OpCost]:
    """Every op of pipeline stage `stage` on one of its ranks."""
    return list(_stage_costs_cached(model, mix, seqs, sampled, stage))


@lru_cache(maxsize=4096)
def _stage_kinds(model: ModelShape, pp: int, stage: int) -> tuple[tuple[str, bool, int], ...]:
    """(token mixer kind, routed experts, how many) of the layers of a pipeline stage."""
    kinds = Counter((model.layers[i].mixer.kind.value, model.layers[i].experts is not None)
                    for i in stage_layers(model, pp, stage))
    return tuple((kind, moe, n) for (kind, moe), n in kinds.items())


def layers_overhead(model: ModelShape, pp: int, stage: int, calibration: Calibration) -> float:
    """The host time of a stage's layers beyond their kernels: a llama layer's, plus what
    a layer of another kind costs more (its mixer's kind, routed experts)."""
    extra = calibration.layer_extra_s
    return sum(n * (calibration.layer_overhead_s + extra.get(kind, 0.0)
                    + (extra.get("moe", 0.0) if moe else 0.0))
               for kind, moe, n in _stage_kinds(model, pp, stage))


def op_seconds(cost: OpCost, share: Share, calibration: Calibration) -> tuple[float, bool]:
    """(time, compute bound) of one op under the roofline with calibrated efficiencies,
    plus its calls' fixed latency (what a call costs however small its work)."""
    eff = calibration.efficiency_for(cost.op, share.ranks)
    shape = calibration.shape_factor(cost.inner, cost.outer)
    compute = cost.flops / (share.peak * eff.compute * shape)
    memory = cost.bytes / (share.bandwidth * eff.memory)
    return max(compute, memory) + cost.calls * calibration.latency_for(cost.op), compute >= memory


def group_link(cluster: Cluster, mix: Mix, dim: str) -> Link:
    """The link a `dim` group runs on: inter-node when any of its groups spans two nodes,
    else intra-node. Ranks are numbered as the engine does, ((dp, pp, cp), tp) with tp
    fastest (cp: the pcp or dcp dimension), replicas one after another."""
    cp = mix.pcp * mix.dcp
    sizes = {"tp": mix.tp, "cp": cp, "pp": mix.pp}
    axis = "cp" if dim in ("dcp", "pcp") else dim
    per_node = cluster.devices_per_node
    for replica in range(mix.dp):
        for pp_i in range(1 if axis == "pp" else mix.pp):
            for cp_i in range(1 if axis == "cp" else cp):
                for tp_i in range(1 if axis == "tp" else mix.tp):
                    nodes = set()
                    for i in range(sizes[axis]):
                        coords = {"pp": pp_i, "cp": cp_i, "tp": tp_i, axis: i}
                        rank = (coords["pp"] * cp + coords["cp"]) * mix.tp + coords["tp"]
                        nodes.add((replica * mix.world + rank) // per_node)
                    if len(nodes) > 1:
                        return cluster.inter
    return cluster.intra


def step_time(model: ModelShape, mix: Mix, cluster: Cluster, calibration: Calibration,
              seqs: tuple[Seq, ...], sampled: int, busy_ranks: int | None = None) -> StepTime:
    """One micro-batch of `seqs` through the slowest pipeline stage of `mix`, on one rank.
    `busy_ranks`: ranks computing at once on a shared host (default: all of the mix's)."""
    share = rank_share(cluster, busy_ranks or mix.devices)
    worst: StepTime | None = None
    for stage in range(mix.pp):
        compute = memory = flops = moved = 0.0
        for cost in stage_costs(model, mix, seqs, sampled, stage):
            seconds, bound = op_seconds(cost, share, calibration)
            compute, memory = compute + seconds * bound, memory + seconds * (not bound)
            flops, moved = flops + cost.flops, moved + cost.bytes
        tokens = sum(s.count * s.new for s in seqs)
        link = sum(_seconds(c, cluster, mix, calibration)
                   for c in step_collectives(model, mix, tokens, sampled, stage))
        layers = len(stage_layers(model, mix.pp, stage))
        overhead = (calibration.step_overhead_s + layers_overhead(model, mix.pp, stage, calibration)
                    + (calibration.rank_overhead_s if mix.tp * mix.dcp * mix.pcp > 1 else 0.0)
                    + (calibration.tp_layer_overhead_s * layers if mix.tp > 1 else 0.0)
                    + (calibration.pp_stage_overhead_s if mix.pp > 1 else 0.0))
        total = compute + memory + link + overhead
        if worst is None or total > worst.seconds:
            worst = StepTime(total, compute, memory, link, overhead, flops, moved)
    assert worst is not None
    return worst


def _seconds(c: Collective, cluster: Cluster, mix: Mix, calibration: Calibration) -> float:
    link = group_link(cluster, mix, "tp" if c.dim == "ep" else c.dim)
    return collective_seconds(c, link, calibration)
