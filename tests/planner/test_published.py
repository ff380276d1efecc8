"""The planner on published hardware figures (the plugins' datasheet tables; no run):
the two results it must reproduce, and a search over every mix of a 671B MoE on 64
devices in under 30 s.

(a) The seed's worked example: long-prompt DeepSeek-V3 prefill on B200s runs faster and
with more throughput per GPU as a TP x PP x EP mix over 16 GPUs than as 8-way TP.
(b) AIConfigurator's Qwen3-32B case on 32 H200s, ISL 4000 / OSL 500, TTFT <= 300 ms,
TPOT <= 10 ms: disaggregated serving gives ~1.7x the per-GPU throughput of aggregated
(AIConfigurator's README; a later release prints 2.39x, 812 vs 340 tokens/s/GPU, for the
same case).
"""

from __future__ import annotations

import time

import pytest

from tokenmill.planner import SLO, Limits, plan
from tokenmill.planner.catalog import model_shape
from tokenmill.planner.cluster import parse_cluster
from tokenmill.planner.workload import parse_workload


@pytest.fixture(scope="module")
def deepseek():
    return model_shape("deepseek-v3")


def test_seed_tp_pp_ep_over_16_b200s_beats_8_way_tp_for_long_prefill(deepseek):
    cluster = parse_cluster("2x8xB200,nvlink=900GB/s,ib=400Gb/s")
    result = plan(deepseek, cluster, parse_workload("isl=32768,osl=1"), pool="prefill")
    by_label = {c.label(): c for c in result.candidates}
    tp8 = by_label["dp2 x tp8"]  # 8-way TP on each host: per-GPU figures of one 8-GPU TP
    mixes = [c for c in result.candidates if c.fits and c.mix.tp > 1 and c.mix.pp > 1
             and c.mix.ep and c.mix.world == 16]
    winners = [c for c in mixes if c.ttft_s < tp8.ttft_s
               and c.tokens_per_s_per_device > tp8.tokens_per_s_per_device]
    assert winners, [(c.label(), c.ttft_s, c.tokens_per_s_per_device) for c in mixes]
    best = winners[0]
    # the band: faster by 5-60% in TTFT, at least as much throughput per GPU (up to +50%)
    assert 1.05 <= tp8.ttft_s / best.ttft_s <= 1.6
    assert 1.0 < best.tokens_per_s_per_device / tp8.tokens_per_s_per_device <= 1.5
    # and the planner ranks it above 8-way TP
    ranks = [c.label() for c in result.candidates]
    assert ranks.index(best.label()) < ranks.index("dp2 x tp8")


def test_aiconfigurator_qwen3_32b_disaggregated_beats_aggregated_per_gpu():
    result = plan(model_shape("qwen3-32b"), parse_cluster("4x8xH200"),
                  parse_workload("isl=4000,osl=500"), SLO(ttft=0.3, tpot=0.010), Limits())
    best_agg = next(c for c in result.candidates if c.kind == "colocated")
    best_dis = next(c for c in result.candidates if c.kind == "disaggregated")
    assert best_agg.meets_slo and best_dis.meets_slo
    assert result.candidates[0].kind == "disaggregated"
    ratio = best_dis.tokens_per_s_per_device / best_agg.tokens_per_s_per_device
    # published ~1.7x (2.39x in a later release, fp8 engines); the band we hold in bf16:
    assert 1.2 <= ratio <= 2.5, ratio
    # AIConfigurator's aggregated best is 340 tokens/s/GPU at TTFT 189 ms, TPOT 9.9 ms
    assert 200 <= best_agg.tokens_per_s_per_device <= 500
    assert best_dis.ttft_s <= 0.3 and best_dis.tpot_s <= 0.010


def test_671b_moe_on_64_devices_searches_every_mix_in_under_30_s(deepseek):
    start = time.perf_counter()
    result = plan(deepseek, parse_cluster("8x8xH200"), parse_workload("isl=4000,osl=500"),
                  SLO(ttft=1.0, tpot=0.05))
    seconds = time.perf_counter() - start
    kinds = {c.kind for c in result.candidates}
    assert kinds == {"colocated", "disaggregated"}
    assert len(result.candidates) > 100
    layouts = {c.mix for c in result.candidates if c.mix is not None}
    assert any(m.pp > 1 and m.ep and m.tp > 1 for m in layouts)  # the mixes are all there
    assert any(m.sp for m in layouts)
    # the engine's own checks drop context parallel for MLA (full multi-head attention only)
    assert not any(m.dcp > 1 or m.pcp > 1 for m in layouts)
    assert seconds < 30, seconds
