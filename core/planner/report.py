"""How a ranking is shown: a table, a sentence on why the first beats the runner-up, a JSON
list, and the command lines that deploy the first (`--apply`)."""

from __future__ import annotations

import math

from tokenmill.planner.mixes import Mix
from tokenmill.planner.search import Candidate
from tokenmill.planner.serving import Limits


def _ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    return "inf" if math.isinf(seconds) else f"{seconds * 1e3:.1f}"


def table(candidates: list[Candidate], top: int) -> str:
    head = ("| # | layout | kind | devices | TTFT ms | TPOT ms | tok/s/device | KV sessions "
            "| binding | SLO |")
    rows = [head, "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for i, c in enumerate(candidates[:top], 1):
        slo = "yes" if c.meets_slo else ("no fit" if not c.fits else "no")
        rows.append(f"| {i} | {c.label()} | {c.kind} | {c.devices} | {_ms(c.ttft_s)} | "
                    f"{_ms(c.tpot_s)} | {c.tokens_per_s_per_device:.1f} | {c.kv_sessions} | "
                    f"{c.binding} | {slo}{' (' + c.note + ')' if c.note else ''} |")
    return "\n".join(rows)


def why(candidates: list[Candidate]) -> str:
    """One sentence: why the first candidate beats the runner-up."""
    if not candidates:
        return "No candidate: no mix of this cluster holds the model."
    first = candidates[0]
    if len(candidates) == 1:
        return f"{first.label()} is the only candidate."
    second = candidates[1]
    if first.meets_slo and not second.meets_slo:
        return (f"{first.label()} wins because it meets the SLO and the runner-up "
                f"{second.label()} does not ({_slo_miss(second)}).")
    reasons = []
    ratio = first.tokens_per_s_per_device / max(second.tokens_per_s_per_device, 1e-12)
    if ratio > 1.005:
        reasons.append(f"{ratio:.2f}x the tokens/s per device")
    if first.ttft_s < second.ttft_s * 0.995 and math.isfinite(second.ttft_s):
        reasons.append(f"{second.ttft_s / first.ttft_s:.2f}x lower TTFT")
    if first.kv_sessions > second.kv_sessions * 1.1:
        reasons.append(f"{first.kv_sessions / max(second.kv_sessions, 1):.1f}x the KV sessions")
    if not reasons:
        return (f"{first.label()} and {second.label()} tie within 0.5% on tokens/s per device "
                f"and TTFT (both bound by {first.binding}); the first is listed first for its "
                f"{'lower TPOT' if first.tpot_s < second.tpot_s else 'fewer devices'}.")
    cause = _cause(first, second)
    return (f"{first.label()} beats {second.label()} with {', '.join(reasons)}: {cause}.")


def _slo_miss(c: Candidate) -> str:
    if not c.fits:
        return c.note or "it does not fit"
    return c.note or f"TTFT {_ms(c.ttft_s)} ms, TPOT {_ms(c.tpot_s)} ms"


def _cause(first: Candidate, second: Candidate) -> str:
    if first.kind != second.kind:
        return (f"as {first.kind} it is bound by {first.binding}, where {second.kind} is "
                f"bound by {second.binding}")
    if first.binding != second.binding:
        return (f"its step is bound by {first.binding}, the runner-up's by {second.binding}")
    a, b = first.mix, second.mix
    if a is not None and b is not None:
        if a.tp < b.tp:
            return (f"both are bound by {first.binding}, and a tensor-parallel group of "
                    f"{a.tp} instead of {b.tp} all-reduces fewer bytes per device")
        if a.pp > b.pp:
            return (f"both are bound by {first.binding}, and {a.pp} pipeline stages hold "
                    "fewer weights per device, leaving more room for KV")
        if a.sp and not b.sp and a.tp == b.tp:
            return (f"both are bound by {first.binding}; sequence parallel runs the norms on "
                    f"1/{a.tp} of the tokens and moves the same bytes as the all-reduces")
        if a.dp > b.dp:
            return (f"both are bound by {first.binding}; {a.dp} replicas of {a.world} ranks "
                    f"need fewer collectives per token than {b.dp} of {b.world}")
        if a.ep and not b.ep:
            return (f"both are bound by {first.binding}; whole experts per device run wider "
                    "GEMMs than experts split by tensor parallel")
    return f"both are bound by {first.binding}; the first spends less of its step on it"


def to_json(candidates: list[Candidate], top: int | None = None) -> list[dict]:
    out = []
    for rank, c in enumerate(candidates[:top] if top else candidates, 1):
        entry: dict = {"rank": rank, "kind": c.kind, "label": c.label()}
        if c.kind == "disaggregated":
            assert c.prefill is not None and c.decode is not None
            entry["layout"] = {key: None for key in ("tp", "pp", "dp", "ep", "sp", "pcp", "dcp")}
            entry["layout"]["devices"] = c.devices
            entry["layout"]["pd"] = {
                "prefill": {**c.prefill.mix.layout(), "instances": c.x},
                "decode": {**c.decode.mix.layout(), "instances": c.y},
            }
        else:
            assert c.mix is not None
            entry["layout"] = {**c.mix.layout(), "pd": None}
        entry.update({
            "ttft_s": _num(c.ttft_s), "tpot_s": _num(c.tpot_s),
            "tokens_per_s_per_device": c.tokens_per_s_per_device,
            "requests_per_s": c.requests_per_s, "kv_sessions": c.kv_sessions,
            "binding": c.binding, "meets_slo": c.meets_slo, "fits": c.fits, "note": c.note,
        })
        out.append(entry)
    return out


def _num(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else x


def apply_commands(c: Candidate, model: str, limits: Limits, devices_per_node: int) -> list[str]:
    """The `tokenmill serve` (and `router`) command lines that deploy `c` (an engine wider
    than a node runs its ranks as Ray actors)."""
    def serve(mix: Mix, extra: list[str]) -> str:
        flags = mix.serve_flags() + ["--max-num-batched-tokens", str(limits.max_num_batched_tokens),
                                     "--max-num-seqs", str(limits.max_num_seqs)]
        if limits.long_prefill_token_threshold:
            flags += ["--long-prefill-token-threshold", str(limits.long_prefill_token_threshold)]
        if mix.devices > devices_per_node:  # more than a node: Ray places the ranks
            flags += ["--distributed-executor-backend", "ray"]
        return " ".join(["tokenmill", "serve", *([model] if model else []), *flags, *extra])

    if c.kind != "disaggregated":
        assert c.mix is not None
        role = {"prefill pool": ["--role", "prefill"], "decode pool": ["--role", "decode"]}
        return [serve(c.mix, role.get(c.kind, []) + ["--port", "8000"])]
    assert c.prefill is not None and c.decode is not None
    lines: list[str] = []
    prefill_urls, decode_urls = [], []
    for i in range(c.x):
        port = 8100 + i
        lines.append(serve(c.prefill.mix, ["--role", "prefill", "--port", str(port)]))
        prefill_urls.append(f"http://HOST:{port}")
    for i in range(c.y):
        port = 8200 + i
        lines.append(serve(c.decode.mix, ["--role", "decode", "--port", str(port)]))
        decode_urls.append(f"http://HOST:{port}")
    lines.append("tokenmill router --prefill " + " ".join(prefill_urls) + " --decode "
                 + " ".join(decode_urls) + " --port 8000")
    return lines
