"""T1 linear attention: every LINEAR backend a plugin declares, per variant it runs,
against the core's reference (`tokenmill.platforms.ops.linear_attention`), states in arena pages.

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

from tokenmill.platforms.interfaces import (
    AttentionKind,
    AttentionSpec,
    RecurrentStateMetadata,
    recurrent_metadata,
)
from tokenmill.platforms.kit.kv_state import read_states, write_states
from tokenmill.platforms.ops.linear_attention import (
    REFERENCE_VARIANTS,
    GatedDeltaInputs,
    KDAInputs,
    ReferenceLinearAttentionBackend,
    gated_delta_state_spec,
    kda_state_spec,
)
from tokenmill.platforms.ops.mamba2 import (
    Mamba2Dims,
    Mamba2Inputs,
    Mamba2Weights,
    mamba2_state_spec,
)
from tokenmill_conformance.errors import ATTENTION_BOUNDS, assert_matches

# Two shapes per variant: "small" (odd, narrow heads, pages smaller than a state) and
# "production" (head dims of Qwen3-Next, Kimi Linear and Bamba, grouped value heads).
DIMS = {
    "small": dict(gated_delta=(2, 4, 32, 16), kda=(2, 16), mamba2=(4, 8, 2, 16, 8)),
    "production": dict(gated_delta=(1, 2, 128, 128), kda=(2, 128), mamba2=(4, 64, 2, 128, 256)),
}


def _gated_delta_case(dtype: torch.dtype, num_tokens: int, gen: torch.Generator, device,
                      dims=DIMS["small"]["gated_delta"]):
    hk, hv, dk, dv = dims
    k = 4
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


def _kda_case(dtype: torch.dtype, num_tokens: int, gen: torch.Generator, device,
              dims=DIMS["small"]["kda"]):
    h, d = dims
    k = 4
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


def _mamba2_case(dtype: torch.dtype, num_tokens: int, gen: torch.Generator, device,
                 dims=DIMS["small"]["mamba2"]):
    heads, head_dim, groups, state, chunk = dims
    dims = Mamba2Dims(num_heads=heads, head_dim=head_dim, num_groups=groups, state_size=state,
                      conv_kernel=4, chunk_size=chunk)
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
STEPS = {
    # ragged: fresh prefills, decodes, a hit on a checkpoint, checkpoints inside a chunk
    "small": [(0, 37, False, [16, 32]), (20, 1, False, []), (48, 1, False, [1]),
              (0, 1, False, []), (16, 21, True, [5, 21]), (64, 9, False, []),
              (32, 1, True, [])],
    # several chunks of the production chunk length (64) per sequence in one step, the
    # state carried across them, with checkpoints on, between and off chunk boundaries;
    # a restore from a checkpoint and a continuation from the slot, both past 64 tokens
    "production": [(0, 150, False, [64, 100, 128]), (130, 80, True, [22, 80]),
                   (64, 70, False, [70]), (300, 1, False, [])],
}
# (bytes per page half, pages): states span several pages either way
PAGES = {"small": (1024, 160), "production": (64 << 10, 48)}
SEEDS = {"small": (0, 1), "production": (0,)}


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


def _step(spec, steps, pages_shape, rng: random.Random, device, poison_value: float):
    page_half, num_pages = pages_shape
    pages = list(range(num_pages))
    rng.shuffle(pages)
    n = -(-spec.state.num_bytes // (2 * page_half))
    take = lambda: [pages.pop() for _ in range(n)]  # noqa: E731
    cache = torch.empty(2, num_pages, page_half, dtype=torch.uint8, device=device)
    cache.view(torch.float32 if page_half % 4 == 0 else torch.uint8).fill_(poison_value)
    slots, sources, checkpoints, restored = [], [], [], []
    for computed, _, restore, marks in steps:
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
    query_lens = [q for _, q, _, _ in steps]
    seq_lens = [c + q for c, q, _, _ in steps]
    return cache, recurrent_metadata(query_lens, seq_lens, rec, spec.block_size, device), restored


@pytest.mark.parametrize("variant", sorted(CASES))
@pytest.mark.parametrize("shape,seed", [(s, n) for s in STEPS for n in SEEDS[s]],
                         ids=[f"{s}-{n}" for s in STEPS for n in SEEDS[s]])
def test_backends_match_the_reference(active, shape, seed, variant):
    runs = [b for b, v in _variants(active) if v == variant]
    if not runs:
        pytest.skip(f"no LINEAR backend of the platform runs {variant!r}")
    device = active.platform.device
    steps = STEPS[shape]
    dims = DIMS[shape][variant]
    for backend in runs:
        for dtype in sorted(active.platform.capabilities.dtypes, key=str):
            if dtype not in ATTENTION_BOUNDS:
                continue
            gen = torch.Generator().manual_seed(seed)
            spec, inputs = CASES[variant](dtype, sum(q for _, q, _, _ in steps), gen, device,
                                          dims)
            if not backend.supports(spec):
                continue
            cache, meta, restored = _step(spec, steps, PAGES[shape], random.Random(seed),
                                          device, float("nan"))
            ref_cache = cache.clone()
            before = cache.clone()
            backend.prepare(meta)
            out = backend.forward(spec, inputs, cache, meta)
            want = ReferenceLinearAttentionBackend().forward(spec, inputs, ref_cache, meta)
            where = (f"dims {dims}, (computed, new, restored, checkpoints) per sequence "
                     f"{steps}")
            op = f"linear attention ({variant}) on {backend.name}"
            assert_matches(out.float(), want.cpu().float(), op=f"{op}: output", shape=where,
                           dtype=dtype, bounds=ATTENTION_BOUNDS[dtype])
            rec = meta.recurrent
            written = rec.state_block_ids + [p for c in rec.checkpoints for _, p in c]
            names = [f"the state of sequence {i}" for i in range(len(steps))] + [
                f"the checkpoint after {n} tokens of sequence {i}"
                for i, marks in enumerate(rec.checkpoints) for n, _ in marks]
            for name, pages in zip(names, written, strict=True):
                got_states = read_states(cache, spec.state, [pages])
                ref_states = read_states(ref_cache, spec.state, [pages])
                for part, got, ref in zip(("conv", "recurrent"), got_states, ref_states,
                                          strict=True):
                    assert_matches(got.float(), ref.cpu().float(), op=f"{op}: {part} {name}",
                                   shape=where, dtype=dtype, bounds=ATTENTION_BOUNDS[dtype])
            touched = {i for ids in written for i in ids}
            for page in range(PAGES[shape][1]):
                if page not in touched:
                    assert torch.equal(cache[:, page].cpu(), before[:, page].cpu()), (
                        f"{backend.name}: page {page} changed, which the step does not write"
                        f" ({'a restore source' if any(page in r for r in restored) else 'unused'})")
