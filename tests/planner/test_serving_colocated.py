"""The colocated step model on figures worked by hand: with B requests decoding, ISL 128,
OSL 12 and a 512-token chunk, a share f = B x 128 / 12 / 128 = B / 12 of the steps
carries a prompt. Throughput is B tokens per mean step ((1 - f) decode alone + f with a
prompt), and for a closed loop of C clients no more than C x OSL / (TTFT + (OSL - 1) x
TPOT): each client has one request in flight at every moment (B, a whole number of
requests, rounds the clients' share of the time decoding up). A request's TPOT is the mean of its 11 steps after its first token, which carry
the other B - 1 requests' prompts (one each per request cycle) and never its own: for B = 2,
1 of 11; for B = 1, none (TPOT = the decode step alone). Step times come from `step_time`
on the step's sequences, written out here."""

from __future__ import annotations

import pytest

from tokenmill.planner.calibration import Calibration
from tokenmill.planner.catalog import model_shape
from tokenmill.planner.cluster import parse_cluster
from tokenmill.planner.mixes import Mix
from tokenmill.planner.ops import Seq
from tokenmill.planner.serving import SLO, Context, Limits, predict_colocated
from tokenmill.planner.step import step_time
from tokenmill.planner.workload import Workload

ISL, OSL = 128, 12


def _figures(clients: int):
    model, cluster, cal = model_shape("qwen3-32b"), parse_cluster("1x1xH200"), Calibration()
    ctx = Context(model, cluster, cal, Workload(ISL, OSL, concurrency=clients), SLO(),
                  Limits(2048, 8, 512))
    p = predict_colocated(ctx, Mix())
    decoding = Seq(ISL + OSL // 2, 1, p.batch)  # at the mean context
    alone = step_time(model, Mix(), cluster, cal, (decoding,), p.batch).seconds
    mixed = step_time(model, Mix(), cluster, cal, (decoding, Seq(0, ISL, 1)), p.batch + 1).seconds
    return p, alone, mixed


def test_two_requests_a_prompt_in_one_of_eleven_gaps():
    p, alone, mixed = _figures(2)
    assert p.batch == 2
    assert p.tpot_s == pytest.approx(10 / 11 * alone + 1 / 11 * mixed, rel=1e-12)
    mean_step = 5 / 6 * alone + 1 / 6 * mixed  # f = 2 / 12
    loop = 2 * OSL / (p.ttft_s + (OSL - 1) * p.tpot_s)
    assert p.tokens_per_s_per_device == pytest.approx(min(2 / mean_step, loop), rel=1e-12)
    assert loop < 2 / mean_step  # here the loop binds: its clients spend TTFT on prompts
    assert p.tpot_s < mean_step  # the request's own prompt is not in its TPOT


def test_one_request_decodes_at_the_decode_step():
    p, alone, mixed = _figures(1)
    assert p.batch == 1
    assert p.tpot_s == pytest.approx(alone, rel=1e-12)
    loop = OSL / (p.ttft_s + (OSL - 1) * alone)
    assert p.tokens_per_s_per_device == pytest.approx(
        min(1 / (11 / 12 * alone + 1 / 12 * mixed), loop), rel=1e-12)


def test_a_shared_hosts_pipeline_stage_computes_a_prompt_chunk_with_its_ranks_share():
    """pp 2 on a shared host (two ranks on this machine's cores): each rank runs with its
    share of the cores as threads (`share_host_cores`), so the stage that carries a prompt
    chunk computes it at half the host even while the other stage only decodes (measured
    since the ranks share: pp2's TTFT 1.2-1.8x tp1's; before, with a thread a core in
    every rank, 1.0-1.1x, and this test held the opposite)."""
    from tokenmill.model.loader import default_model_path

    model, cluster = model_shape(default_model_path()), parse_cluster("1x2xcpu")
    cal = Calibration()
    ctx = Context(model, cluster, cal, Workload(ISL, OSL, concurrency=2), SLO(),
                  Limits(2048, 8, 512))
    mix = Mix(pp=2)
    p = predict_colocated(ctx, mix)
    assert p.batch == 2
    decoding = Seq(ISL + OSL // 2, 1, 1)  # one request per micro-batch
    alone = step_time(model, mix, cluster, cal, (decoding,), 1).seconds
    mixed = step_time(model, mix, cluster, cal, (decoding, Seq(0, ISL, 1)), 2).seconds
    whole_host = step_time(model, mix, cluster, cal, (decoding, Seq(0, ISL, 1)), 2,
                           busy_ranks=1).seconds
    assert whole_host < mixed
    share = 2 * ISL / OSL / ISL  # prompt tokens needed per step over the chunk (ISL)
    service = (1 + 2 - 1) * mixed
    cycle = 2 * ((1 - share) * alone + share * mixed)
    assert p.ttft_s == pytest.approx(service * (1 + share / (2 * (1 - share))) + cycle / 2,
                                     rel=1e-12)
    assert p.tpot_s == pytest.approx(2 * (10 / 11 * alone + 1 / 11 * mixed), rel=1e-12)


def test_a_shared_hosts_prefill_and_decode_pools_are_priced_beside_each_other():
    """1P1D on a shared host (both instances' ranks on this machine's cores): each pool
    computes beside the other's rank, so its steps are priced at half the host, where
    separate devices (two H200s) keep each pool's figures alone. Either way the two
    clients' closed loop settles at the rate Little's law gives (it did not: iterating the
    rate oscillated near the prefill pool's capacity)."""
    from tokenmill.model.loader import default_model_path
    from tokenmill.planner.search import _split, split
    from tokenmill.planner.serving import decode_tpot, predict_decode, predict_prefill

    model = model_shape(default_model_path())
    for text, shared in (("1x2xcpu", True), ("1x2xH200", False)):
        cluster = parse_cluster(text)
        ctx = Context(model, cluster, Calibration(), Workload(ISL, OSL, concurrency=2), SLO(),
                      Limits(2048, 8, 512))
        p, d = predict_prefill(ctx, Mix()), predict_decode(ctx, Mix())
        alone, priced = _split(ctx, p, d, 1, 1), split(ctx, p, d, 1, 1)
        for c in (alone, priced):  # the closed loop settles where Little's law holds
            assert c.requests_per_s == pytest.approx(2 / (c.ttft_s + OSL * c.tpot_s), rel=1e-6)
        if not shared:
            assert priced == alone
            continue
        decoding = Seq(ISL + OSL // 2, 1, 1)
        half = step_time(model, Mix(), cluster, Calibration(), (decoding,), 1, busy_ranks=2)
        whole = step_time(model, Mix(), cluster, Calibration(), (decoding,), 1, busy_ranks=1)
        assert half.seconds > whole.seconds
        beside = Context(model, cluster, Calibration(), ctx.workload, SLO(),
                         Limits(2048, 8, 512), cotenant_ranks=1)
        assert decode_tpot(beside, Mix(), 1) == pytest.approx(half.seconds, rel=1e-12)
        assert decode_tpot(ctx, Mix(), 1) == pytest.approx(whole.seconds, rel=1e-12)
        assert priced.tpot_s > alone.tpot_s and priced.ttft_s > alone.ttft_s
        assert priced.tokens_per_s_per_device < alone.tokens_per_s_per_device
