"""Quantized weights: GGUF blocks against the gguf package's own dequantizer, the
reference quantized linear, a tiny random llama per format against transformers run on
the dequantized weights, the cpu plugin's int4 kernel (and that it runs), and
`--quantization` against the checkpoint."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, dequantize, quantize
from model_harness import PagedHarness
from transformers import LlamaConfig, LlamaForCausalLM

from tokenmill.model.gguf_quant import GGUF_SCHEMES, decode_blocks
from tokenmill.model.linear import Linear
from tokenmill.model.loader import build_model, resolve_quantization
from tokenmill.model.quant import QuantizedCheckpointTensor, QuantizedWeights, scheme_chooser
from tokenmill.platforms.ops import quant, resolve_ops
from tokenmill.platforms.ops.reference import ReferenceAttentionBackend
from tokenmill.platforms.registry import load_platform
from tokenmill_cpu import ops as cpu_ops

SIMPLE = ("Q4_0", "Q4_1", "Q8_0")  # the gguf package quantizes these itself
K_QUANTS = {"Q4_K": (144, [(0, 2), (2, 4)]), "Q6_K": (210, [(208, 210)])}  # block bytes, f16 scales


def _raw(type_name: str, weight: np.ndarray, seed: int = 0) -> np.ndarray:
    """GGUF blocks of `weight` [rows, n]: quantized by gguf for the simple types; random
    blocks with small float16 super-block scales for the K-quants (gguf cannot quantize
    them), whose values `dequantize` then defines."""
    if type_name in SIMPLE:
        return quantize(weight, getattr(GGMLQuantizationType, type_name))
    size, scale_bytes = K_QUANTS[type_name]
    rng = np.random.default_rng(seed)
    rows, n = weight.shape
    raw = rng.integers(0, 256, (rows * (n // 256), size), dtype=np.uint8)
    for lo, hi in scale_bytes:
        raw[:, lo:hi] = rng.uniform(2e-4, 1e-3, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def _kept(type_name: str, raw: np.ndarray, n: int) -> QuantizedCheckpointTensor:
    codes, scales, offsets = decode_blocks(type_name, raw, n)
    return QuantizedCheckpointTensor(
        GGUF_SCHEMES[type_name], torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(scales.astype(np.float32)), torch.from_numpy(offsets.astype(np.float32)))


@pytest.mark.parametrize("type_name", [*SIMPLE, *K_QUANTS])
def test_gguf_blocks_decode_exactly(type_name):
    weight = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32)
    raw = _raw(type_name, weight)
    want = dequantize(raw, getattr(GGMLQuantizationType, type_name))
    assert np.array_equal(_kept(type_name, raw, 512).dense().numpy(), want)


def test_int4_packing_round_trips_and_the_reference_is_a_dense_linear():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8)
    packed = quant.pack_int4(codes)
    assert packed.shape == (8, 32) and torch.equal(quant.unpack_int4(packed), codes)
    scales, offsets = torch.rand(8, 2, generator=g), torch.randn(8, 2, generator=g)
    scheme = quant.QuantScheme("awq", "int4", bits=4, group_size=32)
    weight = quant.QuantizedWeight(scheme, packed, scales, offsets, 64, 8)
    dense = codes.float() * scales.repeat_interleave(32, 1) + offsets.repeat_interleave(32, 1)
    x, bias = torch.randn(3, 64, generator=g), torch.randn(8, generator=g)
    torch.testing.assert_close(quant.quantized_linear(x, weight, bias), F.linear(x, dense, bias))
    with pytest.raises(ValueError, match="group size 32"):
        scheme.scales_shape(8, 48)
    with pytest.raises(ValueError, match="'int3'"):
        quant.QuantScheme("gguf", "int3", bits=3, group_size=32)


def _tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _quantized_checkpoint(hf: LlamaForCausalLM, type_name: str | Callable[[str], str]):
    """(our checkpoint: every projection and the head kept quantized, in `type_name` or
    the type it gives a weight name, plan) and, in `hf`, the same weights dequantized:
    transformers' reference."""
    weights, plan = [], {}
    for name, tensor in hf.state_dict().items():
        if tensor.dim() == 2 and "embed" not in name:
            kind = type_name if isinstance(type_name, str) else type_name(name)
            raw = _raw(kind, tensor.numpy(), seed=len(weights))
            kept = _kept(kind, raw, tensor.shape[1])
            tensor.copy_(kept.dense())
            weights.append((name, kept))
            module = name.removesuffix(".weight")
            for part, fused in (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"),
                                ("v_proj", "qkv_proj"), ("gate_proj", "gate_up_proj"),
                                ("up_proj", "gate_up_proj")):
                module = module.replace(part, fused)
            plan[module] = kept.scheme
        else:
            weights.append((name, tensor.clone()))
    return weights, plan


@pytest.mark.parametrize("type_name", [*SIMPLE, *K_QUANTS])
def test_tiny_model_per_format_matches_transformers_on_the_dequantized_weights(type_name):
    hf = _tiny_llama()
    weights, plan = _quantized_checkpoint(hf, type_name)
    ops = resolve_ops({"prepack_quantized_linear": cpu_ops.prepack_quantized_linear})
    model = build_model(hf.config, weights, dtype=torch.float32, device="cpu", ops=ops,
                        attention_backend=ReferenceAttentionBackend(), block_size=4,
                        schemes=scheme_chooser(plan, torch.float32))
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(layers) == 9 and all(isinstance(m.scheme, QuantizedWeights) for m in layers)
    # the cpu plugin's kernel for the bit width must be the one running, not the reference
    kernel = (cpu_ops.Int4QuantizedLinear if GGUF_SCHEMES[type_name].bits == 4
              else cpu_ops.Uint8QuantizedLinear)
    assert all(isinstance(m._apply_packed, kernel) for m in layers)
    tokens = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    harness = PagedHarness(model, ReferenceAttentionBackend())
    seq = harness.add(tokens)
    got = harness.run([[(seq, 7)], [(seq, 5)]])[id(seq)]
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def _fallback_warnings(records, platform: str) -> list[str]:
    return [r.getMessage() for r in records if r.levelname == "WARNING"
            and f"{platform} has no quantized-linear kernel" in r.getMessage()]


def test_a_platform_without_a_quantized_kernel_logs_each_scheme_once(caplog):
    """Ops that do not override prepack_quantized_linear (a bare platform here; the
    triton plugins' fallback: tests/triton/quant_cases.py) run the reference: one warning
    per scheme naming the platform, however many layers share it."""
    hf = _tiny_llama()
    weights, plan = _quantized_checkpoint(hf, lambda name: "Q8_0" if "mlp" in name else "Q4_0")
    ops = resolve_ops({}, source="platform plugin 'bare'")
    with caplog.at_level("WARNING"):
        for _ in range(2):  # a second model on the same ops: logged already
            build_model(hf.config, weights, dtype=torch.float32, device="cpu", ops=ops,
                        attention_backend=ReferenceAttentionBackend(), block_size=4,
                        schemes=scheme_chooser(plan, torch.float32))
    named = _fallback_warnings(caplog.records, "platform plugin 'bare'")
    assert len(named) == 2, named
    assert any("gguf Q4_0 weights" in m for m in named) and any("gguf Q8_0 weights" in m for m in named)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q6_K"])
def test_the_cpu_platform_runs_its_kernels_without_a_fallback_warning(type_name, caplog):
    """The cpu plugin as the registry loads it: Q4_0 / Q4_1 on the kernels'
    quantized_linear_q4, Q8_0 and Q6_K on quantized_linear_u8; no fallback warning for
    any of its 9 layers, and a batch-1 decode step runs every layer on its kernel."""
    hf = _tiny_llama()
    weights, plan = _quantized_checkpoint(hf, type_name)
    ops = load_platform("cpu").ops
    with caplog.at_level("WARNING"):
        model = build_model(hf.config, weights, dtype=torch.float32, device="cpu", ops=ops,
                            attention_backend=ReferenceAttentionBackend(), block_size=4,
                            schemes=scheme_chooser(plan, torch.float32))
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    kernel = ("tokenmill_cpu.quantized_linear_q4" if type_name.startswith("Q4")
              else "tokenmill_cpu.quantized_linear_u8")
    assert [getattr(m._apply_packed, "kernel", None) for m in layers] == [kernel] * 9
    assert not _fallback_warnings(caplog.records, "platform plugin 'cpu'")
    harness = PagedHarness(model, ReferenceAttentionBackend())
    seq = harness.add(list(range(6)))
    harness.run([[(seq, 5)]])  # the prompt: 5 rows, under either kernel's row limit
    before = [m._apply_packed.rows_by_path["kernel"] for m in layers]
    harness.run([[(seq, 1)]])  # one decode step of one sequence: one row through each layer
    assert [m._apply_packed.rows_by_path["kernel"] - b for m, b in zip(layers, before)] == [1] * 9


def _u8_weight(bits: int, group: int, out: int, inp: int, g: torch.Generator, offsets=True):
    codes = torch.randint(0, 2**bits, (out, inp), generator=g, dtype=torch.uint8)
    scales = torch.rand(out, inp // group, generator=g) * 0.02 + 1e-3
    offs = -torch.rand(out, inp // group, generator=g) * 2**(bits - 1) * 0.02 if offsets else None
    scheme = quant.QuantScheme("gguf", "Q8_0" if bits == 8 else "Q6_K", bits=bits,
                               group_size=group, zero_points=offsets)
    return quant.QuantizedWeight(scheme, codes, scales, offs, inp, out)


@pytest.mark.parametrize(("bits", "group"), [(8, 32), (6, 16), (8, 128)])
@pytest.mark.parametrize("out_features", [96, 577])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_u8_kernel_matches_the_reference(bits, group, out_features, with_bias):
    """Q8_0- and Q6_K-shaped weights (and a GPTQ-like group 128) on the C++ kernel against
    the core's reference: float32 to float32 rounding, bf16 to bf16's; batch 1, 3, 13 (a tile of 4 rows and a remainder)."""
    g = torch.Generator().manual_seed(bits * 1000 + out_features)
    weight = _u8_weight(bits, group, out_features, 256, g, offsets=group != 128)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    fast = cpu_ops.prepack_quantized_linear(weight, bias)
    assert isinstance(fast, cpu_ops.Uint8QuantizedLinear), fast
    for batch in (1, 3, 13):
        x = torch.randn(batch, 256, generator=g)
        want = quant.quantized_linear(x, weight, bias)
        torch.testing.assert_close(fast(x), want, atol=1e-4, rtol=1e-5)
        xb = x.bfloat16()
        got = fast(xb)
        assert got.dtype == torch.bfloat16
        want = quant.quantized_linear(xb.float(), weight, bias)
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=1e-2)
    x3 = torch.randn(2, 5, 256, generator=g)  # leading dims kept
    torch.testing.assert_close(fast(x3), quant.quantized_linear(x3, weight, bias),
                               atol=1e-4, rtol=1e-5)
    assert fast.rows_by_path == {"kernel": 2 * (1 + 3 + 13) + 10, "dequantized": 0}
    # prompt chunks past the kernel's rows: the weight written out in x's dtype, one GEMM
    rows = fast.DEQUANTIZE_ROWS[torch.float32] + 1
    chunk = torch.randn(rows, 256, generator=g)
    torch.testing.assert_close(fast(chunk), quant.quantized_linear(chunk, weight, bias),
                               atol=1e-4, rtol=1e-5)
    rows16 = fast.DEQUANTIZE_ROWS[torch.bfloat16] + 1
    chunk16 = torch.randn(rows16, 256, generator=g).bfloat16()
    got = fast(chunk16)
    assert got.dtype == torch.bfloat16
    # against the weights rounded to bf16 as this path multiplies them (their rounding,
    # up to 0.2 on these sums of 256 products, is the dense bf16 path's too)
    w16 = quant.dequantize(weight).bfloat16().float()
    torch.testing.assert_close(got.float(), F.linear(chunk16.float(), w16, bias),
                               atol=3e-2, rtol=1e-2)
    assert fast.rows_by_path["dequantized"] == rows + rows16
    module = cpu_ops.kernels.load()  # the writer itself: the reference's weights exactly
    out = torch.empty(weight.out_features, 256, dtype=torch.bfloat16)
    module.dequantize_u8_into(out, fast.codes, fast.scales, fast.offsets, fast.group_size)
    # the reference's weights rounded to bf16 (one bf16 step at most: q * s + o is fused)
    torch.testing.assert_close(out.float(), quant.dequantize(weight), atol=1e-6, rtol=2**-7)
    with pytest.raises(RuntimeError, match="dequantize_u8_into needs group % 8 == 0"):
        module.dequantize_u8_into(out, fast.codes, fast.scales, fast.offsets, 12)


def test_cpu_int4_kernel_matches_the_reference_in_bfloat16():
    """ATen's int4 kernel (`Int4PackedLinear`: the 4-bit layers' path for bf16
    activations up to `Int4QuantizedLinear.ATEN_ROWS` rows)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (96, 128), generator=g, dtype=torch.uint8)
    scales = torch.rand(96, 4, generator=g) * 0.02 + 1e-3
    weight = quant.QuantizedWeight(quant.QuantScheme("gguf", "Q4_1", bits=4, group_size=32),
                                   quant.pack_int4(codes), scales, -8 * scales, 128, 96)
    fast = cpu_ops.Int4PackedLinear(weight, None)
    x = torch.randn(5, 128, generator=g).bfloat16()
    want = quant.quantized_linear(x.float(), weight, None)
    torch.testing.assert_close(fast(x).float(), want, atol=3e-2, rtol=2e-2)


def _q4_weight(group: int, out: int, inp: int, g: torch.Generator, offsets=True):
    codes = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
    scales = torch.rand(out, inp // group, generator=g) * 0.02 + 1e-3
    offs = -torch.rand(out, inp // group, generator=g) * 8 * 0.02 if offsets else None
    scheme = quant.QuantScheme("gguf" if group == 32 else "gptq",
                               "Q4_1" if group == 32 else "int4", bits=4, group_size=group,
                               zero_points=offsets)
    return quant.QuantizedWeight(scheme, quant.pack_int4(codes), scales, offs, inp, out)


def test_q4_repack_puts_columns_i_and_i_plus_16_in_one_byte():
    codes = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64).repeat(2, 1)
    codes[1] = torch.randint(0, 16, (64,), generator=torch.Generator().manual_seed(1),
                             dtype=torch.uint8)
    packed = cpu_ops.repack_q4(codes)
    assert packed.shape == (2, 32)
    for r in range(2):
        for b in range(2):
            for i in range(16):
                byte = int(packed[r, 16 * b + i])
                assert byte & 0x0F == codes[r, 32 * b + i] and byte >> 4 == codes[r, 32 * b + 16 + i]
    with pytest.raises(ValueError, match="in_features=48"):
        cpu_ops.repack_q4(torch.zeros(2, 48, dtype=torch.uint8))


@pytest.mark.parametrize(("group", "offsets"), [(32, True), (64, True), (128, False)])
@pytest.mark.parametrize("out_features", [96, 577])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_q4_kernel_matches_the_reference(group, offsets, out_features, with_bias):
    """Q4_0/Q4_1-shaped weights (and GPTQ-like groups 64 and 128) on the C++ 4-bit kernel
    against the core's reference, float32 activations: batch 1, 3, 17 and a 3-D input on
    the kernel, a prompt chunk past KERNEL_ROWS dequantized. bf16 activations on ATen's
    int4 kernel where it takes the shape, else on the C++ kernel (577 rows: odd, not a
    shape ATen's int4 pack takes), and past both dequantized to bf16."""
    g = torch.Generator().manual_seed(group * 1000 + out_features)
    weight = _q4_weight(group, out_features, 256, g, offsets=offsets)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    fast = cpu_ops.prepack_quantized_linear(weight, bias)
    assert isinstance(fast, cpu_ops.Int4QuantizedLinear), fast
    assert fast.kernel == "tokenmill_cpu.quantized_linear_q4"
    small = (1, 3, 17)
    for batch in small:
        x = torch.randn(batch, 256, generator=g)
        torch.testing.assert_close(fast(x), quant.quantized_linear(x, weight, bias),
                                   atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, 5, 256, generator=g)  # leading dims kept
    torch.testing.assert_close(fast(x3), quant.quantized_linear(x3, weight, bias),
                               atol=1e-4, rtol=1e-5)
    assert fast.rows_by_path == {"kernel": sum(small) + 10, "aten_int4": 0, "dequantized": 0}
    rows = fast.KERNEL_ROWS + 1  # a prompt chunk: dequantized in float32
    chunk = torch.randn(rows, 256, generator=g)
    torch.testing.assert_close(fast(chunk), quant.quantized_linear(chunk, weight, bias),
                               atol=1e-4, rtol=1e-5)
    assert fast.rows_by_path["dequantized"] == rows
    before = dict(fast.rows_by_path)
    for batch in (1, 3):
        xb = torch.randn(batch, 256, generator=g).bfloat16()
        got = fast(xb)
        assert got.dtype == torch.bfloat16
        want = quant.quantized_linear(xb.float(), weight, bias)
        torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=2e-2)
    path = "aten_int4" if out_features % 16 == 0 else "kernel"
    assert fast.rows_by_path[path] - before[path] == 4
    # a bf16 chunk past both small-batch paths: the weight dequantized to bf16, one GEMM
    rows = max(fast.KERNEL_ROWS, fast.ATEN_ROWS) + 1
    chunk = torch.randn(rows, 256, generator=g).bfloat16()
    got = fast(chunk)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), quant.quantized_linear(chunk.float(), weight, bias),
                               atol=5e-2, rtol=2e-2)
    assert fast.rows_by_path["dequantized"] == fast.KERNEL_ROWS + 1 + rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_written_out_linear_in_blocks_of_rows(dtype):
    """Many rows through a 4-bit layer whose weight does not fit the scratch budget: it is
    written out and multiplied a block of rows at a time (here 4 KiB: 16 rows a block, the
    last one short), with a 3-D x and a bias, as the reference computes it."""
    g = torch.Generator().manual_seed(3)
    weight = _q4_weight(32, 100, 128, g)
    bias = torch.randn(100, generator=g)
    fast = cpu_ops.prepack_quantized_linear(weight, bias)
    codes = cpu_ops.repack_q4(cpu_ops.unpacked_codes(weight))
    blocks = []

    def write(w, n0, n1):
        blocks.append((n0, n1))
        fast.module.dequantize_q4_into(w, codes[n0:n1], fast.scales[n0:n1],
                                       fast.offsets[n0:n1], 32)

    x = torch.randn(3, 11, 128, generator=g)
    got = cpu_ops.linear_written_out(x.to(dtype), write, 100, bias, scratch_bytes=4096)
    assert blocks == [(n, min(n + 16, 100)) for n in range(0, 100, 16)]
    want = quant.quantized_linear(x.to(dtype).float(), weight, bias)
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("offsets", [True, False])
def test_cpu_q4_dequantize_matches_the_reference(offsets):
    """The kernels' `dequantize_q4_into` (the many-rows path) writes the reference's
    weights: float32 to rounding, bf16 as the reference's rounded to bf16 (nearest even;
    one step off where the fused q * s + o rounds across a bf16 boundary); a wrong output
    tensor is refused naming it."""
    g = torch.Generator().manual_seed(7)
    weight = _q4_weight(64, 96, 256, g, offsets=offsets)
    module = cpu_ops.kernels.load()
    codes = cpu_ops.repack_q4(cpu_ops.unpacked_codes(weight))
    scales = weight.scales.float().contiguous()
    offs = None if weight.offsets is None else weight.offsets.float().contiguous()
    want = quant.dequantize(weight)
    out = torch.empty(96, 256)
    module.dequantize_q4_into(out, codes, scales, offs, 64)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    out16 = torch.empty(96, 256, dtype=torch.bfloat16)
    module.dequantize_q4_into(out16, codes, scales, offs, 64)
    torch.testing.assert_close(out16.float(), want, atol=1e-6, rtol=2**-7)  # one bf16 step
    assert (out16.float() == want.bfloat16().float()).float().mean() > 0.99  # mostly exact
    with pytest.raises(RuntimeError, match=r"float32 or bfloat16 \[96, 256\] tensor, got Half"):
        module.dequantize_q4_into(torch.empty(96, 256, dtype=torch.half), codes, scales, offs, 64)
    with pytest.raises(RuntimeError, match="group % 32 == 0"):
        module.dequantize_q4_into(out, codes, scales, offs, 48)


def test_cpu_q4_kernel_refuses_bad_shapes():
    module = cpu_ops.kernels.load()
    codes = torch.zeros(4, 32, dtype=torch.uint8)
    scales = torch.ones(4, 2)
    with pytest.raises(RuntimeError, match="group=48"):
        module.quantized_linear_q4(torch.zeros(1, 64), codes, scales, None, None, 48)
    with pytest.raises(RuntimeError, match="x has 32 features"):
        module.quantized_linear_q4(torch.zeros(1, 32), codes, scales, None, None, 32)


def _tied_llama(vocab: int = 320) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                         max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("head_type", ["Q8_0", "Q6_K"])
def test_a_quantized_tied_embedding_runs_the_head_on_its_codes(head_type, caplog):
    """SmolLM2's GGUF layout: projections Q4_1, the tied embedding (the head) in Q8_0
    (Q6_K in other files). With the checkpoint's embedding quantized the head runs through
    the platform's quantized linear on the u8 kernel, no fallback; the lookup reads the
    dequantized copy; logits equal transformers' on the dequantized weights."""
    hf = _tied_llama()
    weights, plan = _quantized_checkpoint(hf, "Q4_1")
    embedding = hf.model.embed_tokens.weight
    kept = _kept(head_type, _raw(head_type, embedding.detach().numpy(), seed=99),
                 embedding.shape[1])
    with torch.no_grad():
        embedding.copy_(kept.dense())  # the tied head follows: one tensor
    weights = [(n, kept if n == "model.embed_tokens.weight" else t) for n, t in weights]
    with caplog.at_level("INFO"):
        model = build_model(hf.config, weights, dtype=torch.float32, device="cpu",
                            ops=load_platform("cpu").ops,
                            attention_backend=ReferenceAttentionBackend(), block_size=4,
                            schemes=scheme_chooser(plan, torch.float32))
    assert f"tied LM head runs on the checkpoint's {head_type} codes" in caplog.text
    assert "dequantized at load" not in caplog.text  # the head is not a dense fallback
    head = model._logits_fn
    assert head.kernel == "tokenmill_cpu.quantized_linear_u8", head
    assert torch.equal(model.model.embed_tokens.weight, kept.dense())  # the lookup's copy
    tokens = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    harness = PagedHarness(model, ReferenceAttentionBackend())
    seq = harness.add(tokens)
    got = harness.run([[(seq, 7)], [(seq, 5)]])[id(seq)]
    assert head.rows_by_path["kernel"] > 0 and head.rows_by_path["dequantized"] == 0
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_a_dense_tied_embedding_keeps_the_dense_head():
    hf = _tied_llama()
    weights, plan = _quantized_checkpoint(hf, "Q4_1")
    model = build_model(hf.config, weights, dtype=torch.float32, device="cpu",
                        ops=load_platform("cpu").ops,
                        attention_backend=ReferenceAttentionBackend(), block_size=4,
                        schemes=scheme_chooser(plan, torch.float32))
    assert model.quantized_head is None
    assert getattr(model._logits_fn, "kernel", None) is None


def test_cpu_fallback_is_logged(caplog):
    """A group the kernels take neither (8 bits, group 4: not a multiple of 8) runs the
    reference, and says so."""
    scheme = quant.QuantScheme("gptq", "int8", bits=8, group_size=4)
    weight = quant.QuantizedWeight(scheme, torch.zeros(4, 32, dtype=torch.uint8),
                                   torch.ones(4, 8), torch.zeros(4, 8), 32, 4)
    with caplog.at_level("WARNING"):
        fn = cpu_ops.prepack_quantized_linear(weight, None)
    assert not isinstance(fn, cpu_ops.Int4PackedLinear | cpu_ops.Int4QuantizedLinear
                          | cpu_ops.Uint8QuantizedLinear)
    assert _fallback_warnings(caplog.records, "platform plugin 'cpu'")
    assert "gptq int8 weights (8 bits, group 4)" in caplog.text


def test_the_engine_dequantizes_an_unset_checkpoint_it_cannot_run_quantized(caplog):
    """The default GGUF left unset runs quantized on the cpu plugin; under tensor parallel
    (quantized layers are not split over ranks yet) it is dequantized, logged, and asking
    for `gguf` there is an error naming the value and the way out."""
    from tokenmill.engine.config import EngineArgs
    from tokenmill.engine.wiring import engine_quantization
    from tokenmill.model.loader import default_model_path, load_model_info
    from tokenmill.platforms.registry import load_platform

    info = load_model_info(default_model_path(), load_tokenizer=False)
    cpu = load_platform("cpu")
    assert cpu.platform.capabilities.quantized_weights
    assert engine_quantization(EngineArgs(), info, cpu) == "gguf"
    assert engine_quantization(EngineArgs(quantization="none"), info, cpu) == "none"
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.wiring"):
        assert engine_quantization(EngineArgs(tensor_parallel_size=2), info, cpu) == "none"
    assert "quantized as 'gguf'; tensor_parallel_size=2" in caplog.text
    with pytest.raises(ValueError, match="quantization 'gguf' with tensor_parallel_size=2: .* "
                                         "pass quantization='none'"):
        engine_quantization(EngineArgs(quantization="gguf", tensor_parallel_size=2), info, cpu)


def test_quantization_is_resolved_against_the_checkpoint(tmp_path):
    plain = LlamaConfig()
    awq = LlamaConfig(quantization_config={"quant_method": "awq", "bits": 4})
    gguf_file, hf_dir = str(tmp_path / "m.gguf"), str(tmp_path)
    assert resolve_quantization(gguf_file, plain, None) == "gguf"  # runs as it is
    assert resolve_quantization(gguf_file, plain, "gguf") == "gguf"
    assert resolve_quantization(gguf_file, plain, "none") == "none"
    assert resolve_quantization(hf_dir, plain, None) == "none"
    with pytest.raises(ValueError, match="'awq' does not fit .* quantized as 'gguf'"):
        resolve_quantization(gguf_file, plain, "awq")
    with pytest.raises(ValueError, match="'gguf' does not fit .* quantized as 'none'"):
        resolve_quantization(hf_dir, plain, "gguf")
    assert resolve_quantization(hf_dir, awq, None) == "awq"
    assert resolve_quantization(hf_dir, awq, "none") == "none"  # dequantized at load
    with pytest.raises(ValueError, match="'gptq' does not fit .* quantized as 'awq'; pass "
                                         "--quantization awq or none"):
        resolve_quantization(hf_dir, awq, "gptq")
    other = LlamaConfig(quantization_config={"quant_method": "compressed-tensors"})
    with pytest.raises(ValueError, match="quantization 'compressed-tensors' .* is not supported"):
        resolve_quantization(hf_dir, other, None)
    with pytest.raises(ValueError, match="'int2' is not one of"):
        resolve_quantization(hf_dir, plain, "int2")


@pytest.mark.long  # two loads of the default model and 2 x 24 decode steps: minutes
def test_default_model_runs_as_q4_1_with_the_greedy_tokens_of_the_dequantized_path():
    from tokenmill import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    tokens = {}
    for method in ("gguf", "none"):
        llm = LLM(quantization=method, dtype="float32")
        model = llm.engine.executor.worker.runner.model
        quantized = [m for m in model.modules()
                     if isinstance(m, Linear) and isinstance(m.scheme, QuantizedWeights)]
        assert len(quantized) == (120 if method == "gguf" else 0)  # 30 layers x qkv, o, gate_up, down
        assert all(m.scheme.quant.format == "Q4_1" for m in quantized)
        if method == "gguf":
            assert all(isinstance(m._apply_packed, cpu_ops.Int4QuantizedLinear) for m in quantized)
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        tokens[method] = [o.outputs[0].token_ids for o in outputs]
        llm.engine.shutdown()
    assert tokens["gguf"] == tokens["none"]
