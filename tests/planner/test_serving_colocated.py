"""The colocated step model on figures worked by hand: with B requests decoding, ISL 128,
OSL 12 and a 512-token chunk, a share f = B x 128 / 12 / 128 = B / 12 of the steps
carries a prompt. Throughput is B tokens per mean step ((1 - f) decode alone + f with a
prompt). A request's TPOT is the mean of its 11 steps after its first token, which carry
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
    assert p.tokens_per_s_per_device == pytest.approx(2 / mean_step, rel=1e-12)
    assert p.tpot_s < mean_step  # the request's own prompt is not in its TPOT


def test_one_request_decodes_at_the_decode_step():
    p, alone, mixed = _figures(1)
    assert p.batch == 1
    assert p.tpot_s == pytest.approx(alone, rel=1e-12)
    assert p.tokens_per_s_per_device == pytest.approx(1 / (11 / 12 * alone + 1 / 12 * mixed),
                                                      rel=1e-12)
