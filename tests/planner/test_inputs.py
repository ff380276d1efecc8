"""What `tokenmill plan` reads (clusters, workloads, traces, SLOs) and what it prints (the
table, the JSON ranking, the command lines), through the real command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.planner import parse_slo
from tokenmill.planner.cluster import parse_bandwidth, parse_cluster, parse_latency
from tokenmill.planner.mixes import Mix, valid
from tokenmill.planner.workload import parse_workload
from tokenmill.server.cli import main


def test_cluster_short_form_and_yaml(tmp_path):
    c = parse_cluster("2x8xH200,nvlink=900GB/s,ib=400Gb/s,inter_latency=8us")
    assert (c.nodes, c.devices_per_node, c.devices, c.plugin) == (2, 8, 16, "nvidia")
    assert c.intra.bandwidth == 900e9 and c.inter.bandwidth == 50e9 and c.inter.latency == 8e-6
    assert c.device.memory_bandwidth == 4.8e12 and not c.shared_host
    one = parse_cluster("8xMI300X")
    assert one.nodes == 1 and one.plugin == "rocm" and one.intra.bandwidth == 448e9
    cpu = parse_cluster("1x2xcpu")
    assert cpu.shared_host and cpu.plugin == "cpu"
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("nodes: 4\ndevices_per_node: 4\ndevice: TPU v5e\n"
                         "intra_node: {bandwidth: 200GB/s, latency: 3us}\nmemory: 16GiB\n")
    tpu = parse_cluster(str(yaml_file))
    assert (tpu.devices, tpu.plugin, tpu.intra.latency, tpu.device.memory_bytes) == (
        16, "tpu", 3e-6, 16 << 30)
    with pytest.raises(ValueError, match="unknown cluster option"):
        parse_cluster("8xH200,bogus=1")
    with pytest.raises(Exception, match="'Z100'"):
        parse_cluster("8xZ100")
    assert parse_bandwidth("1.6Tb/s") == 200e9 and parse_latency("500ns") == pytest.approx(5e-7)


def test_workloads_and_the_prefix_hit_rate_of_a_mooncake_trace(tmp_path):
    w = parse_workload("isl=4000,osl=500,rate=2.5,hit=0.25")
    assert (w.isl, w.osl, w.rate, w.new_tokens) == (4000, 500, 2.5, 3000)
    trace = tmp_path / "t.jsonl"
    rows = [  # 512-token blocks; hits are leading blocks sent before
        {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 1536, "output_length": 20, "hash_ids": [1, 2, 3]},
        {"timestamp": 2000, "input_length": 1536, "output_length": 30, "hash_ids": [1, 9, 3]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    t = parse_workload(str(trace))
    # hits: 0, 1024 (blocks 1 and 2), 512 (block 1; block 9 is new, so 3 does not count)
    assert t.hit_rate == pytest.approx((0 + 1024 + 512) / (1024 + 1536 + 1536))
    assert t.rate == pytest.approx(3 / 2.0) and (t.isl, t.osl) == (1365, 20)
    with pytest.raises(ValueError, match="needs isl and osl"):
        parse_workload("isl=10")


def test_agent_session_traces_are_closed_loop_clients():
    traces = Path(__file__).resolve().parents[3] / "shared" / "traces" / "claude-code"
    sessions = parse_workload(str(traces))  # ../shared beside the clone
    assert sessions.concurrency == 60 and sessions.rate is None
    assert 0.5 < sessions.hit_rate < 0.99  # an agent's turns resend their history


def test_slo_parsing():
    assert parse_slo("ttft=300ms,tpot=10ms") == parse_slo("tpot=0.01s,ttft=0.3s")
    with pytest.raises(ValueError, match="ttft=300ms"):
        parse_slo("latency=3s")


def test_engine_rules_decide_validity():
    from tokenmill.planner.catalog import model_shape

    smol = model_shape(None)  # 9 query heads, 3 KV heads
    assert "tensor_parallel_size=2" in valid(smol, Mix(tp=2)) or "divide" in valid(smol, Mix(tp=2))
    assert valid(smol, Mix(tp=3)) is None and valid(smol, Mix(pp=2)) is None
    assert valid(smol, Mix(dcp=2)) is None
    assert "expert parallel" in valid(smol, Mix(tp=3, ep=True))
    assert "one of" in valid(smol, Mix(pcp=2, dcp=2))


def test_plan_command_prints_the_table_the_reason_and_the_commands(capsys):
    assert main(["plan", "--model", "llama-3-70b", "--cluster", "1x8xH200", "--workload",
                 "isl=2000,osl=200", "--slo", "ttft=2s,tpot=50ms", "--apply", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "| 1 |" in out and (" beats " in out or " tie within 0.5% " in out)
    assert "tokenmill serve llama-3-70b" in out


def test_plan_json_lists_every_candidate_with_its_layout(capsys):
    assert main(["plan", "--model", "qwen3-next-80b-a3b", "--cluster", "2x4xH200",
                 "--workload", "isl=8000,osl=300", "--format", "json"]) == 0
    ranking = json.loads(capsys.readouterr().out)
    assert [e["rank"] for e in ranking] == list(range(1, len(ranking) + 1))
    keys = {"tp", "pp", "dp", "ep", "sp", "pcp", "dcp", "devices", "pd"}
    assert all(keys <= set(e["layout"]) for e in ranking)
    assert {"ttft_s", "tpot_s", "tokens_per_s_per_device", "binding"} <= set(ranking[0])
    split = next(e for e in ranking if e["kind"] == "disaggregated")
    assert {"prefill", "decode"} == set(split["layout"]["pd"])
    assert split["layout"]["pd"]["prefill"]["instances"] >= 1


def test_plan_command_names_a_bad_input(capsys):
    assert main(["plan", "--cluster", "8xH200", "--workload", "isl=1"]) == 2
    assert "needs isl and osl" in capsys.readouterr().err


def test_apply_prints_serve_and_router_lines_the_cli_takes():
    """A disaggregated split's `--apply` lines: one `serve --role prefill` a prefill
    instance, one `--role decode` a decode instance, and a router in front of them, each
    accepted by this tokenmill's own parser (P/D has landed: no caveat lines)."""
    import shlex

    from tokenmill.planner import SLO, Limits, plan
    from tokenmill.planner.catalog import model_shape
    from tokenmill.planner.cluster import parse_cluster
    from tokenmill.planner.report import apply_commands
    from tokenmill.planner.workload import parse_workload
    from tokenmill.server.cli import build_parser

    result = plan(model_shape("qwen3-32b"), parse_cluster("4x8xH200"),
                  parse_workload("isl=4000,osl=500"), SLO(ttft=0.3, tpot=0.010), Limits())
    split = next(c for c in result.candidates if c.kind == "disaggregated")
    lines = apply_commands(split, "qwen3-32b", Limits(), 8)
    parser = build_parser()
    roles = []
    for line in lines:
        assert not line.startswith("#"), line
        args = parser.parse_args(shlex.split(line)[1:])
        if args.command == "serve":
            roles.append(args.kv_role)
    assert roles == ["prefill"] * split.x + ["decode"] * split.y
    assert lines[-1].startswith("tokenmill router --prefill http://HOST:8100")
