"""The parallelism planner: which mix of tensor, pipeline, data, expert, sequence and
context parallel (colocated or split into prefill and decode pools) serves a model on a
cluster best for a workload, predicted from a performance model fed by the plugins'
hardware specs, and why (`tokenmill plan`; docs/planner.md)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.planner.calibration import Calibration, for_spec
from tokenmill.planner.cluster import Cluster
from tokenmill.planner.model_shape import ModelShape
from tokenmill.planner.search import Candidate, search
from tokenmill.planner.serving import SLO, Context, Limits
from tokenmill.planner.workload import Workload

__all__ = ["Plan", "plan", "parse_slo", "Candidate", "Limits", "SLO"]


@dataclass(frozen=True)
class Plan:
    context: Context
    candidates: list[Candidate]


def plan(model: ModelShape, cluster: Cluster, workload: Workload, slo: SLO | None = None,
         limits: Limits | None = None, calibration: Calibration | None = None,
         pool: str | None = None) -> Plan:
    """Every candidate of `cluster` for `model` serving `workload`, ranked; `calibration`'s
    efficiencies rescaled to the cluster device's peaks (`calibration.for_spec`)."""
    calibration = for_spec(calibration or Calibration(), cluster.device)
    ctx = Context(model, cluster, calibration, workload, slo or SLO(), limits or Limits())
    return Plan(ctx, search(ctx, pool))


def parse_slo(text: str | None) -> SLO:
    """`ttft=300ms,tpot=10ms` (units s, ms, us) -> SLO."""
    from tokenmill.planner.cluster import parse_latency

    if not text:
        return SLO()
    values = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key.strip() not in ("ttft", "tpot"):
            raise ValueError(f"--slo {text!r}: write ttft=300ms,tpot=10ms")
        values[key.strip()] = parse_latency(value)
    return SLO(values.get("ttft"), values.get("tpot"))
