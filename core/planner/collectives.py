"""What each parallel dimension sends in one step, and how long it takes.

Volumes are the payload bytes a rank hands its communicator, as
`tokenmill.distributed.parallel_state.CountingCommunicator` counts them (all_gather: the
gathered result), per dimension and collective, for a rank of pipeline stage `stage`;
they equal the counts `benchmarks/bench_tp_comm.py` measures (tests/planner/
test_collectives.py runs the mixes it measures and compares). Notation: T tokens of the
step, L the stage's layers, H hidden, b bytes per activation, V vocab, k experts per
token, t tensor-parallel ranks.

Time: a latency-bandwidth model per call on a group of n ranks. Bytes as ring algorithms
move them: all_reduce 2 (n - 1) / n of the payload, all_gather, reduce_scatter and
all_to_all (n - 1) / n, send all of it; each byte costs 1 / (bandwidth x efficiency).
Latency as tree / recursive-doubling algorithms pay it for the small messages of decode
steps (NCCL's, gloo's): ceil(log2 n) steps (all_reduce twice that, reduce then
broadcast), send one, each the link's latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.planner.calibration import Calibration
from tokenmill.planner.cluster import Link
from tokenmill.planner.model_shape import ModelShape

INDEX_BYTES = 8  # int64 counts and expert ids of the expert-parallel dispatch


@dataclass(frozen=True, slots=True)
class Collective:
    dim: str  # "tp", "pp", "dcp", "pcp"
    op: str  # "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_single", "send", "recv"
    payload: float  # bytes this rank hands in over the step's calls (as counted)
    calls: int
    group: int  # ranks in the group


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stage_layers(model: ModelShape, pp: int, stage: int) -> list[int]:
    """The layers of pipeline stage `stage` (the engine's own split)."""
    from tokenmill.model.pipeline import stage_layers as split

    return list(split(model.num_layers, pp, stage)) if pp > 1 else list(range(model.num_layers))


def step_collectives(model: ModelShape, mix, tokens: int, sampled: int, stage: int = 0) -> list[Collective]:
    """Per-rank collectives of one step of `tokens` tokens (`sampled` rows sampled) on a
    rank of `stage` under `mix` (a `tokenmill.planner.mixes.Mix`)."""
    t, b, hidden = mix.tp, model.dtype_bytes, model.hidden
    layers = stage_layers(model, mix.pp, stage)
    first, last = stage == 0, stage == mix.pp - 1
    n_layers = len(layers)
    split = mix.pcp > 1 and tokens >= 2 * mix.pcp
    local = cdiv(tokens, mix.pcp) if split else tokens  # the tokens this rank's tp group runs
    out: list[Collective] = []
    if t > 1:
        out += _tensor_parallel(model, mix, layers, local, first, last)
        if last and sampled:
            out.append(Collective("tp", "all_gather", sampled * t * cdiv(model.vocab, t) * b, 1, t))
    if mix.dcp > 1:
        heads = model.layers[layers[0]].mixer.num_heads // t if layers else 0
        head = model.layers[layers[0]].mixer.qk_dim if layers else 0
        payload = n_layers * mix.dcp * tokens * heads * (head + 1) * 4  # float32 parts + LSEs
        out.append(Collective("dcp", "all_gather", payload, 2 * n_layers, mix.dcp))
    if split:
        rows = mix.pcp * cdiv(tokens, mix.pcp)
        kv = 0
        for i in layers:
            mixer = model.layers[i].mixer
            kv += 2 * rows * max(mixer.num_kv_heads // t, 1) * mixer.qk_dim * b
        out.append(Collective("pcp", "all_gather", kv, 2 * n_layers, mix.pcp))
        if last:
            out.append(Collective("pcp", "all_gather", rows * hidden * b, 1, mix.pcp))
    if mix.pp > 1:
        boundary = tokens * 2 * hidden * b  # (hidden, residual) per token
        if not last:
            out.append(Collective("pp", "send", boundary, 1, 2))
        if not first:
            out.append(Collective("pp", "recv", boundary, 1, 2))
    return out


def _tensor_parallel(model: ModelShape, mix, layers: list[int], tokens: int, first: bool,
                     last: bool) -> list[Collective]:
    """The tp group's collectives (expert parallel runs over the same ranks).

    Without sp: an all_reduce per row-parallel output (o_proj, the MLP's down / the MoE
    layer's combined routed + shared partial) and the embedding's, (2 L + 1) T H b. With
    ep a MoE layer's routed output is whole: only a sharded shared expert is reduced, and
    the dispatch adds row counts (all_to_all), rows out, their expert ids and the outputs
    back (three all_to_all_single, T k (2 H b + 8) / t), then the slices' all_gather.
    With sp each all_reduce becomes a reduce_scatter and each column-parallel input an
    all_gather of t ceil(T / t) rows; ep then routes the rank's own slice (no all_gather,
    and no reduce_scatter for a MoE layer without shared experts)."""
    t, b, hidden = mix.tp, model.dtype_bytes, model.hidden
    moe = [i for i in layers if model.layers[i].experts is not None] if mix.ep else []
    shared = sum(any(lin.name.startswith("shared_") for lin in model.layers[i].linears)
                 for i in moe)
    dense_mlps = len(layers) - len(moe)
    out = []
    if mix.sp:
        padded = t * cdiv(tokens, t) * hidden * b
        pairs = len(layers) + dense_mlps + shared  # attention, dense MLPs, shared experts
        out += [Collective("tp", "reduce_scatter", (pairs + first) * padded, pairs + first, t),
                Collective("tp", "all_gather", (pairs + last) * padded, pairs + last, t)]
    else:
        reduces = len(layers) + dense_mlps + shared + first
        out.append(Collective("tp", "all_reduce", reduces * tokens * hidden * b, reduces, t))
    if moe:
        m, k = len(moe), model.layers[moe[0]].experts.top_k
        out += [Collective("tp", "all_to_all", m * t * INDEX_BYTES, m, t),
                Collective("tp", "all_to_all_single",
                           m * tokens * k * (2 * hidden * b + INDEX_BYTES) / t, 3 * m, t)]
        if not mix.sp:
            out.append(Collective("tp", "all_gather", m * t * cdiv(tokens, t) * hidden * b, m, t))
    return out


_STEPS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0,
          "all_to_all_single": 1.0}  # passes over the data: bytes and latency alike


def collective_seconds(c: Collective, link: Link, calibration: Calibration) -> float:
    """Latency-bandwidth time of `c` on `link` (a calibrated fit of its op and group size
    replaces the link's figures where the calibration has one)."""
    fit = calibration.collective_fit(c.op if c.op != "recv" else "send", c.group)
    latency = fit.latency if fit else link.latency
    bandwidth = fit.bandwidth if fit else link.bandwidth * calibration.link_efficiency
    if c.op == "recv":
        return 0.0  # the sender's send carries the boundary's time
    n = c.group
    if c.op == "send":
        return c.calls * latency + c.payload / bandwidth
    passes = _STEPS[c.op]
    hops = max(1, math.ceil(math.log2(n)))
    return c.calls * passes * hops * latency + passes * (n - 1) / n * c.payload / bandwidth


def replica_volumes(model: ModelShape, mix, tokens: int, sampled: int) -> dict[tuple[str, str], float]:
    """Bytes of one step summed over every rank of one replica, per (dimension, collective):
    what the ranks' counting communicators add up to."""
    ranks_per_stage = mix.tp * mix.pcp * mix.dcp
    totals: dict[tuple[str, str], float] = {}
    for stage in range(mix.pp):
        for c in step_collectives(model, mix, tokens, sampled, stage):
            key = (c.dim, c.op)
            totals[key] = totals.get(key, 0.0) + ranks_per_stage * c.payload
    return totals
