"""Prometheus metrics, vLLM's names with the `tokenmill:` prefix.

Counters and histograms are fed from the engine thread (a `StatsObserver`); gauges of the
engine's state are read at scrape time from the snapshot the engine thread publishes.
Each app has its own registry: no module-level metric objects.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.frontend.async_engine import EngineStats
from tokenmill.frontend.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)


class _EngineCollector:
    """Gauges and counters the engine keeps itself, read from its latest snapshot."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self._labels))
        g.add_metric(list(self._labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self._labels))
        c.add_metric(list(self._labels.values()), value)
        return c

    def collect(self):
        s = self._stats()
        yield self._gauge("tokenmill:num_requests_running", "Requests being computed.", s.num_running)
        yield self._gauge("tokenmill:num_requests_waiting", "Requests waiting to run.", s.num_waiting)
        yield self._gauge("tokenmill:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", s.kv_usage)
        yield self._counter("tokenmill:num_preemptions", "Preemptions since start.", s.num_preemptions)
        yield self._counter(
            "tokenmill:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield self._counter(
            "tokenmill:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
            s.prefix_cache_hits,
        )
        yield from self._kv_tiers(s)
        yield from self._kv_split(s)
        yield from self._spec_decode(s)
        yield from self._roofline(s)
        yield from self._handover(s)

    # metric suffix -> (HandoverStats field, help): P/D disaggregation (docs/disaggregation.md)
    _HANDOVER_COUNTERS = {
        "offered": ("offered", "Prompts computed and held for a decode instance."),
        "received": ("received", "Handovers pulled whole from a prefill instance."),
        "failed": ("failed", "Pulls that failed or timed out (the prompt was computed here)."),
        "bytes": ("bytes_moved", "Bytes of the pulled blocks' pages."),
        "transport_bytes": ("transport_bytes",
                            "Bytes the KV transport itself counted as read into this instance."),
        "blocks_pulled": ("blocks_pulled", "KV blocks (and state pages) pulled."),
        "blocks_skipped": ("blocks_skipped",
                           "KV blocks not pulled: this instance's prefix cache held them."),
        "lease_timeouts": ("lease_timeouts", "Leases freed because no decode instance "
                           "released them in time."),
        "transfer_seconds": ("transfer_seconds", "Seconds pulls took, summed."),
    }

    def _handover(self, s: EngineStats):
        if s.handover is None:
            return
        for suffix, (field, doc) in self._HANDOVER_COUNTERS.items():
            yield self._counter(f"tokenmill:kv_handover_{suffix}", doc,
                                getattr(s.handover, field))
        yield self._gauge("tokenmill:kv_handover_leases_held",
                          "Prompts held under a lease for a decode instance now.",
                          s.handover.leases_held)

    def _spec_decode(self, s: EngineStats):
        """Speculative decoding's counters (vLLM's names, tokenmill's prefix), per
        method; the mean acceptance length is 1 + accepted / drafts."""
        if s.spec is None:
            return
        labels = [*self._labels, "method"]
        values = [*self._labels.values(), s.spec.method]
        for name, doc, value in (
            ("spec_decode_num_drafts", "Verifications: a request's drafts in one step.",
             s.spec.num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
             s.spec.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens the target model accepted.",
             s.spec.num_accepted_tokens),
        ):
            c = CounterMetricFamily(f"tokenmill:{name}", doc, labels=labels)
            c.add_metric(values, value)
            yield c
        c = CounterMetricFamily("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted draft tokens by draft position (0-based).",
                                labels=[*labels, "position"])
        for pos, n in enumerate(s.spec.accepted_per_position):
            c.add_metric([*values, str(pos)], n)
        yield c
        g = GaugeMetricFamily("tokenmill:spec_decode_mean_acceptance_length",
                              "Tokens emitted per verification (accepted drafts + 1).",
                              labels=labels)
        g.add_metric(values, 1.0 + s.spec.num_accepted_tokens / s.spec.num_drafts
                     if s.spec.num_drafts else 0.0)
        yield g

    def _roofline(self, s: EngineStats):
        """The last step against the platform's hardware spec (tokenmill.planner.roofline)."""
        yield self._gauge("tokenmill:model_flops_per_second",
                          "Model FLOP/s of the last step, every rank together.", s.model_flops_per_s)
        yield self._gauge("tokenmill:model_flops_utilization",
                          "Last step's model FLOP/s over the platform's peak (0..1).",
                          s.flops_utilization)
        yield self._gauge("tokenmill:memory_bytes_per_second",
                          "Bytes/s the last step had to move at least (weights, KV, activations).",
                          s.model_bytes_per_s)
        yield self._gauge("tokenmill:memory_bandwidth_utilization",
                          "Last step's bytes/s over the platform's memory bandwidth (0..1).",
                          s.bandwidth_utilization)
        yield self._counter("tokenmill:model_flops", "Model FLOPs computed since start.",
                            s.model_flops_total)
        yield self._counter("tokenmill:model_bytes", "Model bytes moved since start.",
                            s.model_bytes_total)

    def _kv_split(self, s: EngineStats):
        """Blocks in use per attention type: the live split of the one KV pool."""
        labels = [*self._labels, "attention_type"]
        g = GaugeMetricFamily("tokenmill:kv_blocks_in_use",
                              "KV blocks held by live requests, per attention type.",
                              labels=labels)
        for kind, n in sorted(s.kv_blocks_by_type.items()):
            g.add_metric([*self._labels.values(), kind], n)
        yield g
        yield self._gauge("tokenmill:kv_blocks_usable", "KV blocks the pool can hand out.",
                          s.kv_blocks_usable)

    # metric suffix -> (TierStats field, help); one series per tier (label `tier`)
    _TIER_COUNTERS = {
        "hits": ("hits", "KV objects found in the tier."),
        "bytes_written": ("bytes_written", "Bytes saved to the tier (unique content)."),
        "bytes_promoted": ("bytes_promoted", "Bytes copied up into the tier on a hit below."),
        "bytes_read": ("bytes_read", "Bytes read from the tier."),
        "tokens_loaded": ("tokens_loaded", "Tokens of KV loaded from the tier."),
        "tokens_recomputed": (
            "tokens_recomputed", "Tokens the tier held but could not supply (recomputed).",
        ),
        "tokens_recompute_chosen": (
            "tokens_recompute_chosen",
            "Tokens the tier held that the cost model chose to recompute (faster than loading).",
        ),
        "corrupt_objects": ("corrupt", "Objects that failed their checks (deleted)."),
        "errors": ("errors", "Calls that found the tier unreachable."),
    }

    def _kv_tiers(self, s: EngineStats):
        if not s.kv_tiers:
            return
        labels = [*self._labels, "tier"]
        for suffix, (attr, doc) in self._TIER_COUNTERS.items():
            c = CounterMetricFamily(f"tokenmill:kv_offload_{suffix}", doc, labels=labels)
            for tier, stats in s.kv_tiers.items():
                c.add_metric([*self._labels.values(), tier], getattr(stats, attr))
            yield c


class Metrics:
    """One server's metrics; implements `tokenmill.frontend.async_engine.StatsObserver`."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._stats: Callable[[], EngineStats] = EngineStats
        labels = ["model_name"]
        self.prompt_tokens = Counter(
            "tokenmill:prompt_tokens", "Prompt tokens of finished requests.", labels,
            registry=self.registry,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "tokenmill:generation_tokens", "Generated tokens of finished requests.", labels,
            registry=self.registry,
        ).labels(model_name)
        self._success = Counter(
            "tokenmill:request_success", "Finished requests, by finish reason.",
            labels + ["finished_reason"], registry=self.registry,
        )
        self.ttft = Histogram(
            "tokenmill:time_to_first_token_seconds", "Time to first token.", labels,
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.itl = Histogram(
            "tokenmill:inter_token_latency_seconds", "Time between generated tokens.", labels,
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "tokenmill:e2e_request_latency_seconds", "Arrival to finish of a request.", labels,
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.registry.register(_EngineCollector(lambda: self._stats(), model_name))

    def bind_engine(self, stats: Callable[[], EngineStats]) -> None:
        """Read engine gauges through `stats` at scrape time."""
        self._stats = stats

    # ---- StatsObserver (called from the engine thread) -----------------------------------
    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_next_tokens(self, inter_token_s: float, num_tokens: int) -> None:
        per_token = inter_token_s / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(per_token)

    def on_finished(self, output: RequestOutput, e2e_s: float) -> None:
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(sum(len(o.token_ids) for o in output.outputs))
        reason = next((o.finish_reason for o in output.outputs if o.finish_reason), "abort")
        self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
