"""When speculation pays: a cost model of the step, measured online, against the
acceptance each request has shown.

A step of T tokens costs about a + b * T seconds: `a` reads the weights once (decode at
small batch is bound by it), `b` is the per-token compute. A draft token with
probability q of being accepted costs b and yields q tokens, so it raises the step's
tokens per second iff q > b * (B + A) / (a + b * (B + D)), where B rows emit one token
each, A tokens are expected from the D draft tokens already planned. At batch 1 on a
weight-bound device the bound is small (drafts are nearly free); at a large batch on a
compute-bound one it nears 1 and speculation stops. The engine plans the draft tokens
in order of q, highest first, while they pass.

q comes from each request's record: rho, the chance that a draft token is accepted when
the one before it was (an exponential moving average over its verified drafts), so its
i-th draft token is accepted with probability rho^i. A request whose drafts keep
failing stops speculating; one step in `probe_interval` still offers it one draft token
so its rho can recover.

(a, b) are fitted by least squares with exponential forgetting over the engine's
measured steps (tokens, seconds), on top of a prior that does not fade: the platform's
roofline (its hardware spec's peak FLOP/s and memory bandwidth, through
tokenmill.planner.roofline) for a decode step of 1 and of 256 rows, weighted as a few
steps. Measured steps on a machine shared with other work are noisy (and a lucky run of
them can say compute is free); the prior keeps the planner from believing that. Without
a hardware spec and until two different step sizes have been seen, every draft passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StepCostModel:
    """Least-squares fit of seconds = a + b * tokens, with forgetting."""

    decay: float = 0.98
    # (tokens, seconds) steps that never fade, each counted `prior_weight` times
    prior: tuple[tuple[int, float], ...] = ()
    prior_weight: float = 4.0
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        x, y = float(num_tokens), float(seconds)
        self._n = self._n * d + 1.0
        self._sx = self._sx * d + x
        self._sy = self._sy * d + y
        self._sxx = self._sxx * d + x * x
        self._sxy = self._sxy * d + x * y

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None while the steps seen do not determine them."""
        n, sx, sy, sxx, sxy = self._n, self._sx, self._sy, self._sxx, self._sxy
        w = self.prior_weight
        for x, y in self.prior:
            n, sx, sy, sxx, sxy = n + w, sx + w * x, sy + w * y, sxx + w * x * x, sxy + w * x * y
        var = n * sxx - sx * sx
        if n < 2 or var <= 1e-9 * max(1.0, sxx * n):
            return None
        b = (n * sxy - sx * sy) / var
        a = (sy - b * sx) / n
        return max(a, 0.0), max(b, 1e-9)


@dataclass(slots=True)
class OutcomeGuard:
    """What the cost model cannot see (per-request host work of drafting and verifying,
    attention kernels that cost more per query token than per decode row), measured:
    per batch size (rows, in powers of two), the tokens per second of decode steps that
    verified drafts and of those that did not. Where drafting measured slower, steps go
    without drafts; one step in `probe_interval` of each kind keeps both rates fresh."""

    ema: float = 0.2
    probe_interval: int = 16
    rates: dict[tuple[int, bool], float] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def bucket(num_rows: int) -> int:
        return max(num_rows, 1).bit_length()

    def observe(self, num_rows: int, num_emitted: int, seconds: float, drafted: bool) -> None:
        if seconds <= 0 or num_rows <= 0:
            return
        key = (self.bucket(num_rows), drafted)
        rate = num_emitted / seconds
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else (1 - self.ema) * old + self.ema * rate

    def allows(self, num_rows: int) -> bool:
        """Whether this step may carry drafts."""
        b = self.bucket(num_rows)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        spec, plain = self.rates.get((b, True)), self.rates.get((b, False))
        if spec is None or plain is None:
            return spec is None or n % self.probe_interval != 0  # measure both kinds
        if spec >= plain:
            return n % self.probe_interval != 0  # a plain step now and then
        return n % self.probe_interval == 0  # a probe with drafts now and then


@dataclass(slots=True)
class AcceptanceRecord:
    rho: float = 0.7  # P(draft i accepted | draft i - 1 accepted): optimistic at first
    steps_since_offer: int = 0


@dataclass
class AdaptivePlanner:
    """Plans how many of its proposed drafts each decoding request sends this step."""

    enabled: bool = True
    ema: float = 0.3  # weight of the newest verification in rho
    min_rho: float = 0.05
    probe_interval: int = 16
    cost: StepCostModel = field(default_factory=StepCostModel)
    guard: OutcomeGuard = field(default_factory=OutcomeGuard)
    records: dict[str, AcceptanceRecord] = field(default_factory=dict)
    _step_allowed: bool = True

    def forget(self, request_id: str) -> None:
        self.records.pop(request_id, None)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification: `num_accepted` of `num_drafts` drafts were accepted."""
        if num_drafts <= 0:
            return
        rec = self.records.setdefault(request_id, AcceptanceRecord())
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        observed = num_accepted / trials
        rec.rho = (1 - self.ema) * rec.rho + self.ema * observed
        rec.steps_since_offer = 0

    def start_step(self, num_rows: int) -> bool:
        """A step with `num_rows` decoding rows begins: whether it may carry drafts
        (the outcome guard's say)."""
        self._step_allowed = not self.enabled or self.guard.allows(num_rows)
        return self._step_allowed

    def may_draft(self, request_id: str, num_rows: int) -> bool:
        """Whether a first draft token of the request could pass this step (proposing
        costs host time: a request that cannot pass is not asked for drafts)."""
        if not self._step_allowed:
            return False
        model = self.cost.fit() if self.enabled else None
        if model is None:
            return True
        rec = self.records.get(request_id)
        if rec is None or rec.steps_since_offer + 1 >= self.probe_interval:
            return True
        a, b = model
        if rec.rho > b * num_rows / (a + b * num_rows):
            return True
        rec.steps_since_offer += 1
        return False

    def plan(self, proposals: dict[str, list[int]], num_rows: int) -> dict[str, int]:
        """How many drafts each request in `proposals` sends; `num_rows`: decoding rows
        in the step (each emits a token with or without drafts)."""
        if not self.enabled:
            return {rid: len(d) for rid, d in proposals.items()}
        model = self.cost.fit()
        candidates: list[tuple[float, str]] = []
        for rid, drafts in proposals.items():
            rec = self.records.setdefault(rid, AcceptanceRecord())
            rec.steps_since_offer += 1
            q = 1.0
            for _ in drafts:
                q *= rec.rho
                candidates.append((q, rid))
        counts = dict.fromkeys(proposals, 0)
        if model is None:
            for _, rid in candidates:
                counts[rid] += 1
            return counts
        a, b = model
        candidates.sort(key=lambda c: -c[0])
        expected = drafted = 0.0
        for q, rid in candidates:
            if q <= b * (num_rows + expected) / (a + b * (num_rows + drafted)):
                break
            counts[rid] += 1
            expected += q
            drafted += 1
        for rid, n in counts.items():  # a request left out for long gets one token to probe
            rec = self.records[rid]
            if n == 0 and proposals[rid] and rec.steps_since_offer >= self.probe_interval:
                counts[rid] = 1
        return counts
