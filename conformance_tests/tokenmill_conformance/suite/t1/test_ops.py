"""T1 ops: every op a plugin overrides through `tokenmill_ops` against the core reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tokenmill.platforms.interfaces import OP_NAMES
from tokenmill.platforms.ops import quant, reference
from tokenmill_conformance.errors import Bounds, assert_matches
from tokenmill_conformance.suite.conftest import capabilities_of

# Per-dtype bounds of elementwise ops and linear layers against the references: the
# elementwise tolerances, then the error statistics (tokenmill_conformance.errors).
BOUNDS = {
    torch.float32: Bounds(atol=1e-5, rtol=1e-5, rel_rms=2e-6, mean=5e-7, scale=5e-7),
    torch.float16: Bounds(atol=2e-3, rtol=2e-3, rel_rms=1e-3, mean=3e-4, scale=3e-4),
    torch.bfloat16: Bounds(atol=1.6e-2, rtol=1.6e-2, rel_rms=6e-3, mean=2e-3, scale=2e-3),
}
LINEAR_BOUNDS = {
    torch.float32: Bounds(atol=1e-4, rtol=1e-4, rel_rms=1e-5, mean=3e-6, scale=3e-6),
    torch.float16: Bounds(atol=1e-2, rtol=1e-2, rel_rms=3e-3, mean=6e-4, scale=6e-4),
    torch.bfloat16: Bounds(atol=5e-2, rtol=3e-2, rel_rms=1e-2, mean=2.5e-3, scale=2.5e-3),
}
TOLERANCE = {d: dict(atol=b.atol, rtol=b.rtol) for d, b in BOUNDS.items()}
LINEAR_TOLERANCE = {d: dict(atol=b.atol, rtol=b.rtol) for d, b in LINEAR_BOUNDS.items()}
# copy_blocks / swap_blocks are KV movement: tier T2. apply_token_bitmask works in place and
# has its own test below.
T1_OPS = sorted(OP_NAMES - {"copy_blocks", "swap_blocks", "apply_token_bitmask"})


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "op_case" in metafunc.fixturenames:
        caps = capabilities_of(metafunc.config)
        dtypes = [] if caps is None else sorted(caps.dtypes, key=str)
        cases = [(op, d) for op in T1_OPS for d in dtypes]
        ids = [f"{op}-{str(d).removeprefix('torch.')}" for op, d in cases]
        metafunc.parametrize("op_case", cases, ids=ids)
    if "dtype" in metafunc.fixturenames:
        caps = capabilities_of(metafunc.config)
        dtypes = [] if caps is None else sorted(caps.dtypes, key=str)
        metafunc.parametrize("dtype", dtypes, ids=[str(d).removeprefix("torch.") for d in dtypes])


def _inputs(op: str, dtype: torch.dtype, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    tokens, hidden = (1, 7, 33)[seed % 3], (64, 96, 128)[seed % 3]
    if op == "rms_norm":
        return randn(tokens, hidden, scale=3.0), randn(hidden), 1e-6
    if op == "fused_add_rms_norm":
        return randn(tokens, hidden), randn(tokens, hidden), randn(hidden), 1e-5
    if op == "rotary_embedding":
        head, heads, kv_heads, rotary = (64, 4, 2, (64, 32, 64)[seed % 3])
        positions = torch.randint(0, 100, (tokens,), generator=g).to(device)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
        freqs = torch.outer(torch.arange(128).float(), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
        return positions, randn(tokens, heads, head), randn(tokens, kv_heads, head), cache
    if op in ("silu_and_mul", "gelu_tanh_and_mul"):
        return (randn(tokens, 2 * hidden),)
    if op == "moe_experts":
        # 4 experts, top 2 of them per token; biases and gpt-oss's activation on odd seeds
        experts, inter, k = 4, 32, 2
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k, generator=g).softmax(-1).to(device)
        biased = seed % 2 == 1
        return (
            randn(tokens, hidden),
            randn(experts, 2 * inter, hidden, scale=0.2),
            randn(experts, hidden, inter, scale=0.2),
            weights,
            ids.to(device),
            randn(experts, 2 * inter) if biased else None,
            randn(experts, hidden) if biased else None,
            "swiglu_oai" if biased else "silu",
        )
    if op == "prepack_linear":
        bias = randn(48) if seed % 2 else None
        return randn(48, hidden, scale=0.2), bias, randn(tokens, hidden)
    if op == "prepack_quantized_linear":
        return _quantized_inputs(seed, tokens, hidden, randn, g, device)
    raise AssertionError(op)


# (format, bits, group, zero points) per seed: GGUF Q4_1-like int4 with offsets, int8
# with offsets, symmetric int4 in groups of 64 (GPTQ's sym=True), AWQ / GPTQ int4 in groups
# of 128 with zero points, FP8 e4m3 in DeepSeek-V3's 128-column blocks (bits 0: FP8)
QUANT_CASES = (("int4_g32", 4, 32, True), ("int8_g32", 8, 32, True), ("int4_g64", 4, 64, False),
               ("int4_g128", 4, 128, True), ("fp8_1x128", 0, 128, False))


def _quantized_inputs(seed, tokens, hidden, randn, g, device):
    name, bits, group, zero_points = QUANT_CASES[seed]
    out = 48
    if bits == 0:  # 320 columns: a partial last block, as DeepSeek's edges have
        hidden = 320
        scheme = quant.QuantScheme("fp8", "fp8_e4m3", 8, zero_points=False, fp8_block=(1, group))
        codes = (torch.randn(out, hidden, generator=g) * 2).to(torch.float8_e4m3fn)
        scales = torch.rand(out, -(-hidden // group), generator=g) * 0.02 + 1e-3
        weight = quant.QuantizedWeight(scheme, codes.to(device), scales.to(device), None,
                                       hidden, out)
        return weight, randn(out) if seed % 2 else None, randn(tokens, hidden)
    hidden = max(hidden, 2 * group)
    scheme = quant.QuantScheme("gguf", name, bits=bits, group_size=group, zero_points=zero_points)
    codes = torch.randint(0, 1 << bits, (out, hidden), generator=g, dtype=torch.uint8)
    packed = quant.pack_int4(codes) if bits == 4 else codes
    scales = torch.rand(out, hidden // group, generator=g) * (0.4 / (1 << bits)) + 1e-3
    offsets = -scales * (1 << (bits - 1)) * (1 + 0.2 * torch.rand(out, hidden // group, generator=g))
    weight = quant.QuantizedWeight(scheme, packed.to(device), scales.to(device),
                                   offsets.to(device) if zero_points else None, hidden, out)
    bias = randn(out) if seed % 2 else None
    return weight, bias, randn(tokens, hidden)


def _on_cpu(weight: quant.QuantizedWeight) -> quant.QuantizedWeight:
    offsets = None if weight.offsets is None else weight.offsets.cpu()
    return dataclasses.replace(weight, codes=weight.codes.cpu(), scales=weight.scales.cpu(),
                               offsets=offsets)


def _call(fn, op: str, args):
    if op in ("prepack_linear", "prepack_quantized_linear"):
        weight, bias, x = args
        return fn(weight, bias)(x)
    return fn(*args)


def _moe_term_scale(args) -> torch.Tensor:
    """[T, H] float64: sum_j topk_weights[t, j] * |y_tj|, the magnitudes of the terms the MoE
    op sums (y_tj: expert topk_ids[t, j]'s output for token t), from the reference in
    float64. Each y_tj is rounded to the dtype before the weighted sum (the reference's
    contract); two correct kernels may round a y near a rounding boundary apart (their
    float32 accumulation orders differ), which costs one step, eps * |y_tj|, of that term.
    Where experts cancel, that step is large against |out|, so the op's bound counts the
    terms, as a dot product's rounding error bound does, not the sum."""
    hidden, w13, w2, weights, ids, b13, b2, activation = args
    as64 = [t if t is None else t.double() for t in (hidden, w13, w2, b13, b2)]
    scale = torch.zeros(hidden.shape, dtype=torch.float64)
    ones = torch.ones(hidden.shape[0], 1)
    for j in range(ids.shape[1]):
        y = reference.moe_experts(as64[0], as64[1], as64[2], ones, ids[:, j:j + 1], as64[3],
                                  as64[4], activation)
        scale += weights[:, j:j + 1].double() * y.abs()
    return scale


def _assert_moe_close(got: torch.Tensor, expected: torch.Tensor, args, dtype) -> None:
    """|got - expected| <= atol + rtol * |expected| + eps(dtype) * (sum_j w_j |y_j|)."""
    tol = LINEAR_TOLERANCE[dtype]
    bound = (tol["atol"] + tol["rtol"] * expected.double().abs()
             + torch.finfo(dtype).eps * _moe_term_scale(args))
    excess = (got.double() - expected.double()).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"moe_experts {dtype}: {int((excess > 0).sum())} of {excess.numel()} elements outside "
        f"the bound; worst at flat index {worst}: got {got.flatten()[worst].item()}, expected "
        f"{expected.flatten()[worst].item()}, bound {bound.flatten()[worst].item():.4g}")


def test_op_matches_reference(active, op_case):
    op, dtype = op_case
    override = getattr(active.ops, op)
    if override is getattr(reference, op):
        pytest.skip(f"{op} is not overridden: the core's reference is used")
    device = active.platform.device
    linear = op in ("prepack_linear", "moe_experts", "prepack_quantized_linear")
    bounds = (LINEAR_BOUNDS if linear else BOUNDS)[dtype]
    seeds = range(len(QUANT_CASES) if op == "prepack_quantized_linear" else 3)
    for seed in seeds:
        args = _inputs(op, dtype, device, seed)
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        ref_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in before]
        ref_args = [_on_cpu(a) if isinstance(a, quant.QuantizedWeight) else a for a in ref_args]
        expected = _call(getattr(reference, op), op, ref_args)
        got = _call(override, op, args)
        expected = expected if isinstance(expected, tuple) else (expected,)
        got = got if isinstance(got, tuple) else (got,)
        assert len(got) == len(expected), f"{op} returned {len(got)} values"
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, g.shape, e.dtype, e.shape)
            shape = " x ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))
            if op == "moe_experts":
                _assert_moe_close(g.cpu(), e, ref_args, dtype)
                bounds = dataclasses.replace(bounds, atol=float("inf"))  # the bound above
            assert_matches(g, e, op=op, shape=f"inputs {shape}", dtype=dtype, bounds=bounds)
        for a, b in zip(args, before):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"{op} modified one of its inputs"


def test_prepack_linear_owns_its_weights(active):
    """The returned function keeps computing with the weights it was given."""
    dtype = active.platform.default_dtype
    device = active.platform.device
    weight = torch.randn(32, 64).to(dtype).to(device)
    x = torch.randn(5, 64).to(dtype).to(device)
    fn = active.ops.prepack_linear(weight, None)
    first = fn(x)
    torch.testing.assert_close(first.cpu(), F.linear(x.cpu(), weight.cpu()), **LINEAR_TOLERANCE[dtype])
    torch.testing.assert_close(fn(x), first)  # deterministic across calls


def _bitmask_case(seed: int, dtype: torch.dtype, device: torch.device):
    """(logits, bitmask, row_indices): vocab sizes on and off a multiple of 32, masks
    narrower than the vocabulary, all-allowed and all-forbidden words, and row subsets in
    and out of order."""
    g = torch.Generator().manual_seed(seed)
    num_rows, vocab, num_words, rows = [
        (1, 96, 3, [0]),
        (6, 1000, 32, [5, 0, 3]),
        (4, 130, 4, [1, 2]),
        (5, 200, 6, [0, 1, 2, 3, 4]),  # 6 words cover 192 tokens: the last 8 are disallowed
    ][seed]
    logits = (torch.randn(num_rows, vocab, generator=g) * 4).to(dtype).to(device)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), num_words), generator=g,
                            dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] = -1
    bitmask[-1, -1] = 0
    return logits, bitmask.to(device), torch.tensor(rows, dtype=torch.int64, device=device)


def test_apply_token_bitmask_matches_reference(active, dtype):
    """The grammar mask of structured output: exactly the reference's -inf pattern, the
    other values untouched (no tolerance), rows not named untouched, the mask unmodified."""
    override = active.ops.apply_token_bitmask
    if override is reference.apply_token_bitmask:
        pytest.skip("apply_token_bitmask is not overridden: the core's reference is used")
    device = active.platform.device
    for seed in range(4):
        logits, bitmask, rows = _bitmask_case(seed, dtype, device)
        expected = logits.cpu().clone()
        reference.apply_token_bitmask(expected, bitmask.cpu(), rows.cpu())
        mask_before = bitmask.clone()
        got = logits.clone()
        result = override(got, bitmask, rows)
        assert result is None, "apply_token_bitmask works in place and returns None"
        assert got.dtype == logits.dtype and got.shape == logits.shape
        assert torch.equal(got.cpu(), expected), f"case {seed}: the masked logits differ"
        assert torch.equal(bitmask, mask_before), "apply_token_bitmask modified the bitmask"
