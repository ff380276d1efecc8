"""Collective volumes of the performance model against the bytes the engine's counting
communicators record, measured by `benchmarks/bench_tp_comm.py` on real multi-process
engines (gloo on loopback) for the mixes it measures: every rank's count of every
collective of the tp, dcp and pcp groups, per prefill and per decode token."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tokenmill.planner.catalog import shape_of
from tokenmill.planner.collectives import replica_volumes
from tokenmill.planner.mixes import Mix

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_tp_comm  # noqa: E402

PROMPT = list(range(5, 37))  # 32 tokens
DECODE = 3

# bench_tp_comm.MODES, as planner mixes. The test measures one mix per kind of traffic
# (sp's reduce_scatter / all_gather around every tp region; EP's dispatch beside MLA, a
# dense layer and shared experts, with the all_reduces that stay; dcp's partial outputs;
# pcp's keys and values): each is a multi-process engine, ~15 s on a quiet 2-core machine.
# The other mixes of the benchmark (tp2, mixtral ep2, tp4 x ep4, tp2 x dcp2 / pcp2) add
# no kind of traffic; all of them matched when run (docs/planner.md).
MIXES = {
    "tp2": Mix(tp=2), "tp2 + sp": Mix(tp=2, sp=True), "ep2": Mix(tp=2, ep=True),
    "dcp2": Mix(dcp=2), "pcp2": Mix(pcp=2), "tp2 x dcp2": Mix(tp=2, dcp=2),
    "tp2 x pcp2": Mix(tp=2, pcp=2), "tp4 x ep4": Mix(tp=4, ep=True),
}
CASES = [("llama", "tp2 + sp"), ("deepseek_v3", "ep2"), ("llama", "dcp2"), ("llama", "pcp2")]


def planner_bytes(arch_dir: Path, mix: Mix, tokens: int) -> float:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(arch_dir)
    shape = shape_of(config, arch_dir.name, torch.float32)
    return sum(v for (dim, _), v in replica_volumes(shape, mix, tokens, 1).items()
               if dim in bench_tp_comm.DIMS)


@pytest.mark.parametrize("arch,name", CASES, ids=[f"{a}-{n}" for a, n in CASES])
def test_planner_volumes_equal_counted_bytes(tmp_path, arch, name):
    from tiny_models import make_tiny_model

    mode = next(m for a, n, m in bench_tp_comm.MODES if a == arch and n.startswith(name))
    path = make_tiny_model(tmp_path / arch, arch)
    got = bench_tp_comm.measure_mix(path, mode, PROMPT, DECODE)
    mix = MIXES[name]
    assert got["prefill"] == planner_bytes(path, mix, len(PROMPT))
    assert got["decode"] == planner_bytes(path, mix, 1)
    # the benchmark's own formula agrees too (the planner is not checked against itself)
    assert got["decode"] == bench_tp_comm.formula(mode, got["hf"], 1, 1)
