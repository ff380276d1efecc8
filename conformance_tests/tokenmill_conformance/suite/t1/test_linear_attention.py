"""T1 linear attention: every LINEAR backend a plugin declares, per variant it runs,
against the core's reference (`tokenmill.ops.linear_attention`), states in arena pages.

Ragged steps mix fresh prefills (their slot pages hold NaN: a fresh state is zeros, never
read), prefill chunks and decodes that continue from their slot, a first step after a
prefix-cache hit (the state comes from a checkpoint's pages, which must stay unchanged),
and checkpoints inside chunks and at their ends. Outputs, every slot and every
checkpoint written must equal the reference's; pages the step should not touch must keep
their bytes. Each dtype the platform declares, with the attention tolerances.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kv.state import read_states, write_states
from tokenmill.ops.linear_attention import (
    REFERENCE_VARIANTS,
    GatedDeltaInputs,
    KDAInputs,
    ReferenceLinearAttentionBackend,
    gated_delta_state_spec,
    kda_state_spec,
)
from tokenmill.ops.mamba2 import Mamba2Dims, Mamba2Inputs, Mamba2Weights, mamba2_state_spec
from tokenmill.platforms.interfaces import (
    AttentionKind,
    AttentionSpec,
    RecurrentStateMetadata,
    recurrent_metadata,
)
from tokenmill_conformance.attention_harness import TOLERANCE

PAGE_HALF = 1024  # bytes per page half: states span several pages
NUM_PAGES = 160


def _gated_delta_case(dtype: torch.dtype, num_tokens: int, gen: torch.Generator, device):
    hk, hv, dk, dv, k = 2, 4, 32, 16, 4
    conv = 2 * hk * dk + hv * dv
    spec = AttentionSpec(AttentionKind.LINEAR, hv, hk, dk, dtype, 16,
                         state=gated_delta_state_spec(conv, k, hv, dk, dv, dtype))
    inputs = GatedDeltaInputs(
        mixed_qkv=torch.randn(num_tokens, conv, generator=gen).to(dtype).to(device),
        g=(-F.softplus(torch.randn(num_tokens, hv, generator=gen)) * 0.5).to(device),
        beta=torch.rand(num_tokens, hv, generator=gen).to(dtype).to(device),
        conv_weight=(torch.randn(conv, k, generator=gen) * 0.5).to(dtype).to(device),
        conv_bias=None,
        num_k_heads=hk, head_k_dim=dk, num_v_heads=hv, head_v_dim=dv,
    )
    return spec, inputs


def _kda_case(dtype: torch.dtype, num_tokens: int, gen: torch.Generator, device):
    h, d, k = 2, 16, 4
    spec = AttentionSpec(AttentionKind.LINEAR, h, h, d, dtype, 16,
                         state=kda_state_spec(h, d, k, dtype))
    inputs = KDAInputs(
        mixed_qkv=torch.randn(num_tokens, 3 * h * d, generator=gen).to(dtype).to(device),
        g=(-F.softplus(torch.randn(num_tokens, h, d, generator=gen)) * 0.5).to(device),
        beta=torch.rand(num_tokens, h, generator=gen).to(dtype).to(device),
        conv_weight=(torch.randn(3 * h * d, k, generator=gen) * 0.5).to(dtype).to(device),
        num_heads=h, head_dim=d,
    )
    return spec, inputs


def _mamba2_case(dtype: torch.dtype, num_tokens: int, gen: torch.Generator, device):
    dims = Mamba2Dims(num_heads=4, head_dim=8, num_groups=2, state_size=16, conv_kernel=4,
                      chunk_size=8)
    spec = AttentionSpec(AttentionKind.LINEAR, dims.num_heads, dims.num_groups,
                         dims.state_size, dtype, 16, state=mamba2_state_spec(dims, dtype))
    weights = Mamba2Weights(
        conv_weight=(torch.randn(dims.conv_dim, 4, generator=gen) * 0.5).to(dtype).to(device),
        conv_bias=torch.randn(dims.conv_dim, generator=gen).to(dtype).to(device),
        dt_bias=torch.randn(dims.num_heads, generator=gen).to(dtype).to(device),
        A=(-torch.rand(dims.num_heads, generator=gen) - 0.2).to(device),
        D=torch.randn(dims.num_heads, generator=gen).to(dtype).to(device),
    )
    inputs = Mamba2Inputs(
        xbc=torch.randn(num_tokens, dims.conv_dim, generator=gen).to(dtype).to(device),
        dt=torch.randn(num_tokens, dims.num_heads, generator=gen).to(dtype).to(device),
        weights=weights, dims=dims,
    )
    return spec, inputs


# variant -> a maker of (spec, inputs) for a step of num_tokens tokens; a variant added to
# the core's REFERENCE_VARIANTS adds its maker here
CASES = {"gated_delta": _gated_delta_case, "kda": _kda_case, "mamba2": _mamba2_case}

# (tokens already computed, query length, restore from a checkpoint, checkpoints at n)
STEP = [(0, 37, False, [16, 32]), (20, 1, False, []), (48, 1, False, [1]), (0, 1, False, []),
        (16, 21, True, [5, 21]), (64, 9, False, []), (32, 1, True, [])]


def _backends(active):
    return [b for b in active.attention_backends if b.kind == AttentionKind.LINEAR]


def _variants(active) -> list[tuple[object, str]]:
    return [(b, v) for b in _backends(active) for v in sorted(b.variants)]


def test_declared_variants_have_a_reference_and_a_case(active):
    for backend, variant in _variants(active):
        assert variant in REFERENCE_VARIANTS, (
            f"backend {backend.name!r} runs variant {variant!r}, which the core has no "
            "reference for")
        assert variant in CASES, f"no conformance case for variant {variant!r} yet"


def _step(spec, rng: random.Random, device, poison_value: float):
    pages = list(range(NUM_PAGES))
    rng.shuffle(pages)
    n = -(-spec.state.num_bytes // (2 * PAGE_HALF))
    take = lambda: [pages.pop() for _ in range(n)]  # noqa: E731
    cache = torch.empty(2, NUM_PAGES, PAGE_HALF, dtype=torch.uint8, device=device)
    cache.view(torch.float32 if PAGE_HALF % 4 == 0 else torch.uint8).fill_(poison_value)
    slots, sources, checkpoints, restored = [], [], [], []
    for computed, _, restore, marks in STEP:
        slot = take()
        slots.append(slot)
        if computed == 0:
            sources.append(None)  # NaN pages: must not be read
        elif restore:
            src = take()
            restored.append(src)
            sources.append(src)
        else:
            sources.append(slot)
        checkpoints.append([(m, take()) for m in marks])
    # valid states where a step reads them
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    readable = [s for s in sources if s is not None]
    states = [torch.randn(len(readable), *t.shape, generator=gen).mul(0.3).to(t.dtype)
              for t in spec.state.tensors]
    write_states(cache, spec.state, readable, [s.to(device) for s in states])
    rec = RecurrentStateMetadata(slots, sources, checkpoints)
    query_lens = [q for _, q, _, _ in STEP]
    seq_lens = [c + q for c, q, _, _ in STEP]
    return cache, recurrent_metadata(query_lens, seq_lens, rec, spec.block_size, device), restored


@pytest.mark.parametrize("seed", [0, 1])
def test_backends_match_the_reference(active, seed):
    if not _backends(active):
        pytest.skip("the platform declares no LINEAR backend")
    device = active.platform.device
    for backend, variant in _variants(active):
        for dtype in sorted(active.platform.capabilities.dtypes, key=str):
            if dtype not in TOLERANCE:
                continue
            gen = torch.Generator().manual_seed(seed)
            spec, inputs = CASES[variant](dtype, sum(q for _, q, _, _ in STEP), gen, device)
            if not backend.supports(spec):
                continue
            cache, meta, restored = _step(spec, random.Random(seed), device, float("nan"))
            ref_cache = cache.clone()
            before = cache.clone()
            backend.prepare(meta)
            out = backend.forward(spec, inputs, cache, meta)
            want = ReferenceLinearAttentionBackend().forward(spec, inputs, ref_cache, meta)
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(out.cpu().float(), want.cpu().float(), **tol)
            rec = meta.recurrent
            written = rec.state_block_ids + [p for c in rec.checkpoints for _, p in c]
            for got, ref in zip(read_states(cache, spec.state, written),
                                read_states(ref_cache, spec.state, written), strict=True):
                torch.testing.assert_close(got.cpu().float(), ref.cpu().float(), **tol)
            touched = {i for ids in written for i in ids}
            for page in range(NUM_PAGES):
                if page not in touched:
                    assert torch.equal(cache[:, page].cpu(), before[:, page].cpu()), (
                        f"{backend.name}: page {page} changed, which the step does not write"
                        f" ({'a restore source' if any(page in r for r in restored) else 'unused'})")
