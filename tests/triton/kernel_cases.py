"""The shared Triton kernels (plugins/triton) against the core's references.

Run by tests/triton/test_triton_kernels.py in a fresh process with TRITON_INTERPRET=1 when
there is no GPU (Triton decides at import whether kernels are interpreted, so the rest of
the test session must not see the variable). Shapes are tiny: the interpreter runs every
program in Python. bf16 runs with the float32-upcast tiles the plugins use in the
interpreter (its bf16 tl.dot is wrong); test_interpreter_bf16_dot_is_still_wrong says
whether that is still needed.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from moe_reference import reference_moe, reference_routing

from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill.platforms.ops import reference
from tokenmill_conformance.attention_harness import (
    check_step,
    make_step,
    mixed_batch,
)
from tokenmill_triton import elementwise, moe
from tokenmill_triton.attention import (
    FP8_FORMATS,
    TritonPagedAttention,
    paged_attention,
    write_kv,
)
from tokenmill_triton.configs import AttentionConfig, KernelConfigs, MoEConfig, interpreter_mode
from tokenmill_triton.rounding import fp8_bits, to_dtype

DEVICE = "cpu" if interpreter_mode() else "cuda"
# Small tiles, so that the tiny shapes still cross tile, page and segment boundaries.
CONFIGS = KernelConfigs(
    attention=AttentionConfig(block_m=16, tile_n=16, decode_block_m=16, decode_tile_n=32,
                              num_segments=4, split_k_min_seq_len=48),
    moe=MoEConfig(block_m=16, block_n=32, block_k=16, group_m=2),
    upcast_bf16_dot=interpreter_mode(),
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ELEMENTWISE_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _on_device(step):
    from tokenmill_conformance.attention_harness import to_device

    return to_device(step, torch.device(DEVICE))


# ---- attention -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("kind", [AttentionKind.FULL, AttentionKind.SLIDING_WINDOW],
                         ids=lambda k: k.value)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3)], ids=lambda h: f"{h[0]}x{h[1]}")
def test_attention_mixed_batch_with_poisoned_slots(dtype, kind, heads):
    window = 13 if kind is AttentionKind.SLIDING_WINDOW else None
    spec = AttentionSpec(kind, heads[0], heads[1], 64, dtype, 16, window)
    backend = TritonPagedAttention(kind, CONFIGS, "test")
    check_step(backend, spec, _on_device(make_step(mixed_batch(1), spec, 1, poison=True)))


@pytest.mark.parametrize("head_size", [64, 128, 256, 80])
def test_attention_head_sizes(head_size):
    spec = AttentionSpec(AttentionKind.FULL, 4, 2, head_size, torch.float32, 8, scale=0.2)
    backend = TritonPagedAttention(AttentionKind.FULL, CONFIGS, "test")
    check_step(backend, spec, _on_device(make_step([(20, 1), (0, 9), (5, 4)], spec, 2)))


@pytest.mark.parametrize("window", [None, 20])
def test_split_k_decode_equals_one_segment(window):
    """Long decodes split into segments (the config splits at 48 tokens) agree with the
    one-segment kernel and with the reference."""
    kind = AttentionKind.FULL if window is None else AttentionKind.SLIDING_WINDOW
    spec = AttentionSpec(kind, 8, 2, 64, torch.float32, 16, window)
    step = _on_device(make_step([(150, 1), (3, 1), (64, 1), (47, 1)], spec, 3, poison=True))
    backend = TritonPagedAttention(kind, CONFIGS, "test")
    split = check_step(backend, spec, step)  # writes the step's keys, then attends
    one = paged_attention(step.query, step.kv_cache, step.metadata, 64**-0.5, CONFIGS, window,
                          num_segments=1)
    torch.testing.assert_close(split, one, atol=1e-5, rtol=1e-5)


def _sink_reference(query, kv_cache, metadata, scale, sinks):
    """reference.paged_attention's math with one extra logit per head in the denominator."""
    out = torch.empty_like(query)
    starts = metadata.query_start_loc.tolist()
    group = query.shape[1] // kv_cache.shape[3]
    for i in range(metadata.num_seqs):
        q = query[starts[i]: starts[i + 1]].float()
        seq_len = metadata.seq_lens_cpu[i]
        k, v = reference.gather_kv(kv_cache, metadata.block_tables[i], seq_len)
        k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q.shape[0], seq_len).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(seq_len) > q_pos, float("-inf"))
        sink = sinks.float()[:, None, None].expand(-1, q.shape[0], 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
        out[starts[i]: starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


@pytest.mark.parametrize("segments", [1, 4])
def test_attention_sinks(segments):
    spec = AttentionSpec(AttentionKind.FULL, 4, 2, 64, torch.float32, 16)
    step = make_step([(40, 1), (0, 7), (90, 1)], spec, 4)
    reference.write_kv(step.key, step.value, step.kv_cache, step.metadata.slot_mapping)
    sinks = torch.tensor([0.5, -1.0, 3.0, 8.0])
    expected = _sink_reference(step.query, step.kv_cache, step.metadata, 0.125, sinks)
    step = _on_device(step)
    got = paged_attention(step.query, step.kv_cache, step.metadata, 0.125, CONFIGS,
                          sinks=sinks.to(DEVICE), num_segments=segments)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_write_kv_skips_padding_slots():
    cache = torch.zeros(2, 4, 8, 2, 64, device=DEVICE)
    key, value = torch.randn(3, 2, 64, device=DEVICE), torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.tensor([9, -1, 31], device=DEVICE)
    write_kv(key, value, cache, slots, CONFIGS)
    expected = torch.zeros(2, 4, 8, 2, 64)
    reference.write_kv(key[[0, 2]].cpu(), value[[0, 2]].cpu(), expected, slots[[0, 2]].cpu())
    assert torch.equal(cache.cpu(), expected)


# ---- element-wise ops ------------------------------------------------------------------

def _randn(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _close(got, expected, dtype):
    got, expected = (got,) if not isinstance(got, tuple) else got, expected
    expected = (expected,) if not isinstance(expected, tuple) else expected
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g.cpu(), e.cpu(), **ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_rms_norms(dtype):
    cfg = CONFIGS.elementwise
    for tokens, hidden in ((1, 64), (7, 96), (5, 1000)):
        x, r = _randn(tokens, hidden, dtype=dtype, scale=3), _randn(tokens, hidden, dtype=dtype,
                                                                     seed=1)
        w = _randn(hidden, dtype=dtype, seed=2)
        _close(elementwise.rms_norm(x, w, 1e-6, cfg), reference.rms_norm(x, w, 1e-6), dtype)
        _close(elementwise.fused_add_rms_norm(x, r, w, 1e-5, cfg),
               reference.fused_add_rms_norm(x, r, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("rotary", [64, 32])
def test_rotary(dtype, rotary):
    positions = torch.tensor([0, 5, 99, 3], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
    freqs = torch.outer(torch.arange(128).float(), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)
    q, k = _randn(4, 6, 64, dtype=dtype), _randn(4, 3, 64, dtype=dtype, seed=1)
    before = (q.clone(), k.clone())
    got = elementwise.rotary_embedding(positions, q, k, cache, CONFIGS.elementwise)
    _close(got, reference.rotary_embedding(positions, q, k, cache), dtype)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_silu_and_mul(dtype):
    for shape in ((1, 128), (9, 2 * 300)):
        x = _randn(*shape, dtype=dtype, scale=2)
        _close(elementwise.silu_and_mul(x, CONFIGS.elementwise), reference.silu_and_mul(x), dtype)


def test_token_bitmask_is_exact():
    g = torch.Generator().manual_seed(0)
    for vocab, words, rows in ((96, 3, [0]), (1000, 32, [5, 0, 3]), (200, 6, [0, 1, 2, 3, 4])):
        logits = torch.randn(6, vocab, generator=g).to(DEVICE)
        mask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=g,
                             dtype=torch.int64).to(torch.int32).to(DEVICE)
        row_ids = torch.tensor(rows, device=DEVICE)
        expected = logits.cpu().clone()
        reference.apply_token_bitmask(expected, mask.cpu(), row_ids.cpu())
        elementwise.apply_token_bitmask(logits, mask, row_ids, CONFIGS.elementwise)
        assert torch.equal(logits.cpu(), expected)


# ---- mixture of experts ----------------------------------------------------------------

@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_routing_matches_softmax_top_k(top_k):
    logits = _randn(11, 8, dtype=torch.float32, scale=2)
    for renormalize in (True, False):
        ids, weights = moe.route(logits, top_k, renormalize)
        ref_ids, ref_weights = reference_routing(logits.cpu(), top_k, renormalize)
        assert torch.equal(ids.cpu().long(), ref_ids)
        torch.testing.assert_close(weights.cpu(), ref_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (37, 8, 2), (20, 6, 3)])
def test_fused_moe_matches_reference(dtype, tokens, experts, top_k):
    hidden, inter = 64, 48
    x = _randn(tokens, hidden, dtype=dtype)
    w1 = _randn(experts, 2 * inter, hidden, dtype=dtype, scale=0.1, seed=1)
    w2 = _randn(experts, hidden, inter, dtype=dtype, scale=0.1, seed=2)
    logits = _randn(tokens, experts, dtype=torch.float32, seed=3)
    got = moe.fused_moe(x, w1, w2, logits, top_k, CONFIGS)
    expected = reference_moe(x.cpu(), w1.cpu(), w2.cpu(), logits.cpu(), top_k)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_moe_experts_matches_the_core_reference(dtype, activation):
    """The core's op: given routing, biases and gpt-oss's clamped SwiGLU on request."""
    tokens, experts, hidden, inter, top_k = 13, 5, 64, 32, 2
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    x = _randn(tokens, hidden, dtype=dtype)
    w13 = _randn(experts, 2 * inter, hidden, dtype=dtype, scale=0.2, seed=1)
    w2 = _randn(experts, hidden, inter, dtype=dtype, scale=0.2, seed=2)
    biased = activation == "swiglu_oai"
    b13 = _randn(experts, 2 * inter, dtype=dtype, seed=3) if biased else None
    b2 = _randn(experts, hidden, dtype=dtype, seed=4) if biased else None
    args = (x, w13, w2, weights.to(DEVICE), ids.to(DEVICE), b13, b2, activation)
    got = moe.moe_experts(*args, configs=CONFIGS)
    expected = reference.moe_experts(*[a.cpu() if isinstance(a, torch.Tensor) else a
                                       for a in args])
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)
    if interpreter_mode() and dtype == torch.bfloat16:
        # float32 accumulation, rounded to bf16 (to nearest even) exactly where the
        # reference rounds: here that leaves no difference at all
        assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_gelu_tanh_and_mul(dtype):
    x = _randn(9, 2 * 300, dtype=dtype, scale=2)
    _close(elementwise.gelu_tanh_and_mul(x, CONFIGS.elementwise),
           reference.gelu_tanh_and_mul(x), dtype)


def test_backend_takes_sinks_from_the_spec():
    spec = AttentionSpec(AttentionKind.SLIDING_WINDOW, 8, 2, 64, torch.float32, 16, 7,
                         sinks=True)
    backend = TritonPagedAttention(AttentionKind.SLIDING_WINDOW, CONFIGS, "test")
    assert backend.supports(spec)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(0)) * 2
    check_step(backend, spec, _on_device(make_step(mixed_batch(5), spec, 0, poison=True)),
               sinks=sinks)


def test_align_by_expert_groups_and_pads():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    pair_ids, block_expert = moe.align_by_expert(ids, num_experts=4, block_m=2)
    pairs = pair_ids.view(-1, 2).cpu().tolist()
    experts = block_expert.cpu().tolist()
    assert experts == [0, 1, 2, 2, -1, -1, -1]  # cdiv(6, 2) + 4 blocks; expert 3 has none
    assert pairs[:4] == [[1, 4], [3, 6], [0, 2], [5, 6]]  # pair id 6 = padding


# ---- the interpreter quirk the plugins work around --------------------------------------

@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))


@triton.jit
def _cast_kernel(x_ptr, out_ptr, N: tl.constexpr, RTNE: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, to_dtype(tl.load(x_ptr + i), tl.bfloat16, RTNE))


def _cast_cases() -> torch.Tensor:
    """float32 values whose bf16 rounding is hard: ties (low half exactly 0x8000) with an
    even and an odd kept bit, just below and above a tie, carries into the exponent, the
    largest finite values (round up to inf), infinities, NaN, zeros, subnormals."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 2**31 - 1, (512,), generator=g, dtype=torch.int64)
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0xFFFF, 0x0000, 0x0001])
    bits = ((base[:, None] & 0x7FFF0000) | low[None, :]).flatten()
    special = torch.tensor([0x3F80FFFF, 0x3F81FFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F800000,
                            0x7FC00000, 0x00000000, 0x00008000, 0x00018000, 0x007FFFFF])
    bits = torch.cat((bits, special))
    bits = torch.cat((bits, bits | 0x80000000))  # and every case negative
    return bits.to(torch.int32).view(torch.float32)


def test_in_kernel_bf16_rounding_matches_torch_bit_for_bit():
    x = _cast_cases().to(DEVICE)
    n = triton.next_power_of_2(x.numel())
    padded = torch.zeros(n, device=DEVICE)
    padded[:x.numel()] = x
    out = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    _cast_kernel[(1,)](padded, out, n, RTNE=True)
    expected = padded.cpu().to(torch.bfloat16)
    same = out.cpu().view(torch.int16) == expected.view(torch.int16)
    both_nan = out.cpu().isnan() & expected.isnan()
    assert bool((same | both_nan).all()), padded.cpu()[~(same | both_nan)][:8]


@pytest.mark.skipif(not interpreter_mode(), reason="only the interpreter has the quirk")
def test_interpreter_bf16_cast_still_truncates():
    """Why tokenmill_triton.rounding exists: when this fails, Triton's interpreter rounds
    float32 -> bf16 to nearest and kernels can drop RTNE_BF16."""
    x = _cast_cases()
    n = triton.next_power_of_2(x.numel())
    padded = torch.zeros(n)
    padded[:x.numel()] = x
    out = torch.empty(n, dtype=torch.bfloat16)
    _cast_kernel[(1,)](padded, out, n, RTNE=False)
    truncated = (padded.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    normal = padded.isfinite() & ((padded == 0) | (padded.abs() >= torch.finfo().tiny))
    assert torch.equal(out[normal], truncated[normal])
    assert not torch.equal(out[normal], padded[normal].to(torch.bfloat16))


@pytest.mark.skipif(not interpreter_mode(), reason="only the interpreter has the quirk")
def test_interpreter_bf16_dot_is_still_wrong():
    """Why KernelConfigs.upcast_bf16_dot exists: when this fails, Triton fixed its
    interpreter and the upcast can go."""
    a, b = torch.randn(16, 32).bfloat16(), torch.randn(32, 16).bfloat16()
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, 16, 16, 32)
    assert (c - a.float() @ b.float()).abs().max() > 1.0


@triton.jit
def _fp8_kernel(x_ptr, out_ptr, N: tl.constexpr, MAX: tl.constexpr, MANT: tl.constexpr,
                MIN_EXP: tl.constexpr, BIAS: tl.constexpr, ENCODE: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.minimum(tl.maximum(tl.load(x_ptr + offs), -MAX), MAX)
    if ENCODE:
        tl.store(out_ptr + offs, fp8_bits(x, MANT, MIN_EXP, BIAS))
    else:
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty))


def _fp8_cases(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, every midpoint (ties) and its two neighbours,
    values past the range, and normal noise at six scales; both signs."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = codes[codes.isfinite()].sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    noise = torch.cat([torch.randn(512, generator=torch.Generator().manual_seed(0)) * s
                       for s in (1e-5, 1e-3, 1e-1, 10.0, 1e3, 1e5)])
    x = torch.cat((finite, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                   torch.tensor([1e6, -1e6]), noise))
    n = triton.next_power_of_2(x.numel())
    return torch.nn.functional.pad(x, (0, n - x.numel()))


@pytest.mark.parametrize("dtype", list(FP8_FORMATS), ids=str)
def test_in_kernel_fp8_encoding_matches_torch_bit_for_bit(dtype):
    """The KV write's FP8 encoding (saturate, round to nearest even) is torch's cast."""
    x = _fp8_cases(dtype).to(DEVICE)
    out = torch.empty(x.numel(), dtype=torch.uint8, device=DEVICE)
    limit = torch.finfo(dtype).max
    _fp8_kernel[(1,)](x, out, x.numel(), limit, *FP8_FORMATS[dtype], ENCODE=True)
    expected = x.cpu().clamp(-limit, limit).to(dtype).view(torch.uint8)
    bad = out.cpu() != expected
    assert not bad.any(), x.cpu()[bad][:8]


@pytest.mark.skipif(not interpreter_mode(), reason="only the interpreter has the quirk")
def test_interpreter_fp8_cast_still_rounds_wrong():
    """Why tokenmill_triton.rounding.fp8_bits exists: when this fails, Triton's interpreter
    casts float32 -> fp8 as torch does and the KV write can cast again."""
    x = _fp8_cases(torch.float8_e4m3fn)
    out = torch.empty(x.numel(), dtype=torch.float8_e4m3fn)
    _fp8_kernel[(1,)](x, out, x.numel(), 448.0, 3, -6, 7, ENCODE=False)
    expected = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert not torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
