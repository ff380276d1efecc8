"""T1 linear attention: every variant a LINEAR backend declares against the core's
reference (`tokenmill.ops.linear_attention.ReferenceLinearAttentionBackend`).

One ragged step mixes a fresh prompt taking checkpoints at block boundaries, a prefill
chunk continuing from its slot, a sequence restarting from a prefix-cache checkpoint
(read only: copy on extend), decodes (one taking a checkpoint) and a one-token prompt;
then several steps of decode and chunks on the same pages. States live in shuffled
pages; every fresh slot and every unused page holds NaN bytes, so a backend that reads a
fresh sequence's slot, or writes outside the pages it was given, fails. Outputs match the
reference within the dtype's tolerance; every state written (slots, checkpoints) matches
the reference's; the checkpoint a sequence restarted from is unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from tokenmill.kv.state import pages_for, read_states, write_states
from tokenmill.ops.linear_attention import (
    REFERENCE_VARIANTS,
    GatedDeltaInputs,
    ReferenceLinearAttentionBackend,
    gated_delta_state_spec,
)
from tokenmill.ops.mamba2 import Mamba2Dims, Mamba2Inputs, Mamba2Weights, mamba2_state_spec
from tokenmill.platforms.interfaces import (
    AttentionKind,
    AttentionSpec,
    LinearAttentionBackend,
    RecurrentStateMetadata,
    recurrent_metadata,
)
from tokenmill_conformance.attention_harness import TOLERANCE
from tokenmill_conformance.suite.conftest import conformance_of

BLOCK = 4
PAGE_BYTES = 1024


def _mamba2(dtype: torch.dtype, gen: torch.Generator):
    dims = Mamba2Dims(num_heads=4, head_dim=8, num_groups=2, state_size=16, conv_kernel=4,
                      chunk_size=8)
    weights = Mamba2Weights(
        conv_weight=(torch.randn(dims.conv_dim, 4, generator=gen) * 0.5).to(dtype),
        conv_bias=torch.randn(dims.conv_dim, generator=gen).to(dtype),
        dt_bias=torch.randn(dims.num_heads, generator=gen).to(dtype),
        A=-torch.rand(dims.num_heads, generator=gen) - 0.2,
        D=torch.randn(dims.num_heads, generator=gen).to(dtype),
    )
    spec = AttentionSpec(AttentionKind.LINEAR, dims.num_heads, dims.num_groups, dims.state_size,
                         dtype, BLOCK, state=mamba2_state_spec(dims, dtype))

    def inputs(num_tokens: int) -> Mamba2Inputs:
        return Mamba2Inputs(torch.randn(num_tokens, dims.conv_dim, generator=gen).to(dtype),
                            torch.randn(num_tokens, dims.num_heads, generator=gen).to(dtype),
                            weights, dims)

    return spec, inputs


def _gated_delta(dtype: torch.dtype, gen: torch.Generator):
    hk, dk, hv, dv, width = 2, 16, 4, 8, 4
    conv_dim = 2 * hk * dk + hv * dv
    conv_weight = (torch.randn(conv_dim, width, generator=gen) * 0.5).to(dtype)
    conv_bias = torch.randn(conv_dim, generator=gen).to(dtype)
    spec = AttentionSpec(AttentionKind.LINEAR, hv, hk, dk, dtype, BLOCK,
                         state=gated_delta_state_spec(conv_dim, width, hv, dk, dv, dtype))

    def inputs(num_tokens: int) -> GatedDeltaInputs:
        return GatedDeltaInputs(
            mixed_qkv=torch.randn(num_tokens, conv_dim, generator=gen).to(dtype),
            g=-torch.rand(num_tokens, hv, generator=gen),
            beta=torch.rand(num_tokens, hv, generator=gen).to(dtype),
            conv_weight=conv_weight, conv_bias=conv_bias, num_k_heads=hk, head_k_dim=dk,
            num_v_heads=hv, head_v_dim=dv,
        )

    return spec, inputs


# variant -> (dtype, generator) -> (spec, a maker of inputs for n tokens)
VARIANT_CASES: dict[str, Callable] = {"mamba2": _mamba2, "gated_delta": _gated_delta}


def _linear_backends(config: pytest.Config) -> list[LinearAttentionBackend]:
    active = conformance_of(config).active
    if active is None:
        return []
    return [b for b in active.attention_backends if b.kind == AttentionKind.LINEAR]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "variant_case" in metafunc.fixturenames:
        active = conformance_of(metafunc.config).active
        dtypes = [] if active is None else sorted(active.platform.capabilities.dtypes, key=str)
        cases = [
            (b.name, v, d) for b in _linear_backends(metafunc.config)
            for v in sorted(b.variants) if v in VARIANT_CASES for d in dtypes
        ]
        ids = [f"{n}-{v}-{str(d).removeprefix('torch.')}" for n, v, d in cases]
        metafunc.parametrize("variant_case", cases, ids=ids)


def test_every_declared_variant_has_a_reference(active):
    for backend in (b for b in active.attention_backends if b.kind == AttentionKind.LINEAR):
        assert backend.variants, f"linear backend {backend.name!r} declares no variant"
        missing = sorted(set(backend.variants) - set(REFERENCE_VARIANTS))
        assert not missing, (
            f"backend {backend.name!r} declares variants {missing}, which this core has no "
            "reference for; it cannot be certified until the core adds one"
        )
        untested = sorted(set(backend.variants) - set(VARIANT_CASES))
        assert not untested, f"this suite has no T1 inputs for variants {untested} yet"


class _Pages:
    """Shuffled page ids of one state cache, handed out a state at a time."""

    def __init__(self, per_state: int, num_states: int, seed: int) -> None:
        self.per_state = per_state
        self.free = list(range(per_state * num_states + 1))
        random.Random(seed).shuffle(self.free)

    def take(self) -> list[int]:
        return [self.free.pop() for _ in range(self.per_state)]


def _random_state(spec: AttentionSpec, gen: torch.Generator) -> list[torch.Tensor]:
    return [(torch.randn(1, *t.shape, generator=gen) * 0.3).to(t.dtype) for t in spec.state.tensors]


def _check(active, backend, spec, make_inputs, cache, seqs, gen) -> None:
    """One step: `seqs` is a list of (cached, new, source, checkpoints at) per sequence,
    source "slot", "hit" or None. Runs the backend and the reference on copies."""
    device = active.platform.device
    pages = _Pages(pages_for(spec.state, PAGE_BYTES), 64, seed=len(seqs))
    slots, sources, checkpoints, hits = [], [], [], []
    for _, _, source, marks in seqs:
        slot = pages.take()
        slots.append(slot)
        if source == "slot":
            write_states(cache, spec.state, [slot], _random_state(spec, gen))
            sources.append(slot)
        elif source == "hit":
            hit = pages.take()
            write_states(cache, spec.state, [hit], _random_state(spec, gen))
            sources.append(hit)
            hits.append(hit)
        else:
            sources.append(None)
        checkpoints.append([(n, pages.take()) for n in marks])
    rec = RecurrentStateMetadata(slots, sources, checkpoints)
    query_lens = [new for _, new, _, _ in seqs]
    metadata = recurrent_metadata(query_lens, [c + n for c, n, _, _ in seqs], rec, BLOCK, device)
    inputs = make_inputs(sum(query_lens))
    ref_cache = cache.clone()
    want = ReferenceLinearAttentionBackend().forward(spec, inputs, ref_cache, metadata)
    hit_before = [read_states(cache, spec.state, [h]) for h in hits]
    got_cache = cache.clone().to(device)
    backend.prepare(metadata)
    got = backend.forward(spec, _to(inputs, device), got_cache, metadata)
    tol = TOLERANCE[spec.dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), **tol)
    got_cache = got_cache.cpu()
    written = slots + [ids for cps in checkpoints for _, ids in cps]
    for ids in written:
        for g, w in zip(read_states(got_cache, spec.state, [ids]),
                        read_states(ref_cache, spec.state, [ids]), strict=True):
            torch.testing.assert_close(g.float(), w.float(), **tol)
    for h, before in zip(hits, hit_before, strict=True):
        after = read_states(got_cache, spec.state, [h])
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), (
            "the backend wrote into the prefix-cache checkpoint it restarted from"
        )
    untouched = sorted(pages.free)
    assert torch.equal(got_cache[:, untouched], cache[:, untouched]), (
        "the backend wrote into pages no sequence of the step was given"
    )
    cache.copy_(ref_cache)


def _to(inputs, device):
    fields = {f: getattr(inputs, f) for f in inputs.__slots__}
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    if "weights" in moved:
        w = moved["weights"]
        moved["weights"] = type(w)(*(None if t is None else t.to(device) for t in (
            w.conv_weight, w.conv_bias, w.dt_bias, w.A, w.D)))
    return type(inputs)(**moved)


def test_mixed_step_matches_reference(active, variant_case):
    name, variant, dtype = variant_case
    backend = next(b for b in _linear_backends_of(active) if b.name == name)
    gen = torch.Generator().manual_seed(0)
    spec, make_inputs = VARIANT_CASES[variant](dtype, gen)
    assert backend.supports(spec)
    cache = torch.full((2, 64 * pages_for(spec.state, PAGE_BYTES) + 1, PAGE_BYTES // 2), 255,
                       dtype=torch.uint8)  # NaN bytes everywhere
    seqs = [
        (0, 13, None, [4, 8, 12]),  # fresh prompt, checkpoints at block boundaries
        (8, 6, "slot", []),  # a prefill chunk continuing
        (16, 5, "hit", [4]),  # restarting from a checkpoint, one more on the way
        (21, 1, "slot", []),  # decodes
        (23, 1, "slot", [1]),  # a decode ending a block: its checkpoint
        (30, 1, "slot", []),
        (0, 1, None, []),  # a one-token prompt
    ]
    _check(active, backend, spec, make_inputs, cache, seqs, gen)


def test_steps_of_decodes_and_chunks(active, variant_case):
    name, variant, dtype = variant_case
    backend = next(b for b in _linear_backends_of(active) if b.name == name)
    gen = torch.Generator().manual_seed(1)
    spec, make_inputs = VARIANT_CASES[variant](dtype, gen)
    cache = torch.full((2, 64 * pages_for(spec.state, PAGE_BYTES) + 1, PAGE_BYTES // 2), 255,
                       dtype=torch.uint8)
    for step in range(3):
        seqs = [(10 + step, 1, "slot", []) for _ in range(5)] + [(4 * step, 7, "slot", [])]
        _check(active, backend, spec, make_inputs, cache, seqs, gen)


def _linear_backends_of(active) -> list[LinearAttentionBackend]:
    return [b for b in active.attention_backends if b.kind == AttentionKind.LINEAR]
