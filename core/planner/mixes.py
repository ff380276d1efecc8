"""Parallel mixes: one engine's layout (tensor, pipeline, expert, sequence, prefill and
decode context parallel) times data-parallel replicas, and which of them the engine runs.

Validity is the engine's own: the checks `EngineArgs` and the model's split functions make
before any worker starts (`local_config` for tensor and expert parallel,
`check_pipeline`, `check_sequence_parallel`, `check_decode_context_parallel`, the
multi-head layout prefill context parallel needs), called on the config alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tokenmill.planner.model_shape import MixerKind, ModelShape


@dataclass(frozen=True, slots=True, order=True)
class Mix:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False  # experts split whole over the tp ranks (all-to-all dispatch)
    sp: bool = False  # activations split by token between tensor-parallel regions
    pcp: int = 1
    dcp: int = 1

    @property
    def world(self) -> int:
        """Ranks of one engine (replica)."""
        return self.tp * self.pp * self.pcp * self.dcp

    @property
    def devices(self) -> int:
        return self.world * self.dp

    @property
    def ep_size(self) -> int:
        return self.tp if self.ep else 1

    def label(self) -> str:
        parts = [f"dp{self.dp}"] if self.dp > 1 else []
        parts += [f"{name}{size}" for name, size in (("tp", self.tp), ("pp", self.pp),
                  ("pcp", self.pcp), ("dcp", self.dcp)) if size > 1]
        parts += ([f"ep{self.tp}"] if self.ep else []) + (["sp"] if self.sp else [])
        return " x ".join(parts) or "tp1"

    def layout(self) -> dict[str, int | bool]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep_size, "sp": self.sp,
                "pcp": self.pcp, "dcp": self.dcp, "devices": self.devices}

    def serve_flags(self) -> list[str]:
        """`tokenmill serve` flags of this mix."""
        flags = []
        for flag, size in (("-tp", self.tp), ("-pp", self.pp), ("-dp", self.dp),
                           ("-pcp", self.pcp), ("-dcp", self.dcp)):
            if size > 1:
                flags += [flag, str(size)]
        if self.ep:
            flags.append("--enable-expert-parallel")
        if self.sp:
            flags.append("--enable-sequence-parallelism")
        return flags


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def engine_layouts(devices: int, model: ModelShape, max_tp: int) -> Iterator[Mix]:
    """Every engine layout (dp 1) whose ranks divide `devices`, with tp at most `max_tp`
    (a node), that the engine accepts for `model`."""
    for world in divisors(devices):
        for tp in (d for d in divisors(world) if d <= max_tp):
            for pp in divisors(world // tp):
                cp = world // tp // pp
                for ep in (False, True) if tp > 1 else (False,):
                    for sp in (False, True) if tp > 1 else (False,):
                        for pcp, dcp in ((cp, 1), (1, cp)) if cp > 1 else ((1, 1),):
                            mix = Mix(tp=tp, pp=pp, ep=ep, sp=sp, pcp=pcp, dcp=dcp)
                            if valid(model, mix) is None:
                                yield mix


def valid(model: ModelShape, mix: Mix) -> str | None:
    """None when the engine runs `model` under `mix`; else why not (its own error text)."""
    try:
        _check(model, mix)
    except ValueError as exc:
        return str(exc)
    return None


def _check(model: ModelShape, mix: Mix) -> None:
    from tokenmill.model.context_parallel import check_decode_context_parallel
    from tokenmill.model.pipeline import check_pipeline
    from tokenmill.model.registry import check_sequence_parallel, family_for

    config: Any = model.hf_config
    if mix.ep and not any(layer.experts for layer in model.layers):
        raise ValueError("expert parallel needs a MoE model")
    if mix.dcp > 1 and mix.pcp > 1:
        raise ValueError("one of decode / prefill context parallel at a time")
    if mix.pp > 1 and (mix.pcp > 1 or mix.sp):
        raise ValueError("pipeline parallel does not combine with pcp or sp yet")
    family = family_for(config)
    if mix.tp > 1:
        family.local_config(config, mix.tp, expert_parallel=mix.ep)
    if mix.sp:
        check_sequence_parallel(config)
    if mix.pp > 1:
        check_pipeline(config, mix.pp, family.pipeline_parallel)
    specs = [layer.spec for layer in model.layers]
    if mix.dcp > 1:
        check_decode_context_parallel(specs, 16, mix.dcp)
    if mix.pcp > 1:
        bad = [i for i, layer in enumerate(model.layers)
               if layer.mixer.kind not in (MixerKind.FULL, MixerKind.SLIDING)]
        if bad:
            raise ValueError(f"prefill context parallel needs multi-head attention layers; "
                             f"layers {bad[:4]} are not")
