"""Quantized MoE experts kept quantized (tokenmill.model.quant.QuantizedExperts): a tiny
random Qwen3-MoE and Mixtral whose experts (one tensor per expert and projection, as
AutoAWQ, GPTQModel and FP8 checkpoints store them) and other linears are quantized and
packed by test_hf_quantization's packers, loaded by tokenmill's loader with the format
detected, logits against transformers run on the same weights dequantized. The experts
must be held as codes (not a dequantized float copy) and run on the cpu plugin's int4
kernel where the scheme has one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from test_hf_quantization import (
    LINEARS,
    _fp8_quantize,
    _load,
    _logits,
    _pack_awq,
    _pack_gptq,
    _quantize,
)
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tokenmill.distributed.parallel_state import GroupCoordinator, ParallelLayout, ParallelState
from tokenmill.model.linear import DenseWeights, LayerBuilder
from tokenmill.model.moe import FusedMoE
from tokenmill.model.quant import PackedExperts, QuantizedExperts
from tokenmill.platforms.ops.quant import QuantScheme
from tokenmill.platforms.registry import load_platform
from tokenmill_cpu import ops as cpu_ops

NUM_EXPERTS, MOE_INTER, HIDDEN = 4, 128, 256


def _tiny_moe(arch: str, mlp_only_layers: list[int] | None = None):
    """hidden 256, experts of 128 (so groups of 32 / 64 / 128 divide both projections)."""
    common = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, num_experts_per_tok=2, vocab_size=256,
                  max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    if arch == "qwen3_moe":  # layer 1 keeps a dense MLP, quantized as a linear
        config = Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=MOE_INTER,
                                num_experts=NUM_EXPERTS, decoder_sparse_step=1,
                                mlp_only_layers=[1] if mlp_only_layers is None
                                else mlp_only_layers, norm_topk_prob=True, **common)
        return Qwen3MoeForCausalLM(config).eval()
    config = MixtralConfig(intermediate_size=MOE_INTER, num_local_experts=NUM_EXPERTS, **common)
    return MixtralForCausalLM(config).eval()


def _quantize_into(tensors: dict, prefix: str, weight: torch.Tensor, method: str, group: int):
    """`weight` quantized in `method`'s layout into `tensors` under `prefix`, and
    overwritten (in place: the HF model's parameter) with its dequantized value."""
    if method == "fp8":
        codes, scale = _fp8_quantize(weight, (128, 128))
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        weight.copy_(codes.float() * full[: weight.shape[0], : weight.shape[1]])
        tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale_inv"] = codes, scale
        return
    q, z, s = _quantize(weight, group, min_zero=1 if method == "gptq" else 0)
    weight.copy_((q - z.repeat_interleave(group, 1)).float()
                 * s.float().repeat_interleave(group, 1))
    parts = _pack_awq(q, z, s) if method == "awq" else _pack_gptq(q, z, s, group)
    tensors.update({f"{prefix}.{part}": value for part, value in parts.items()})


def _expert_names(arch: str, layer_prefix: str, expert: int) -> dict[str, str]:
    """Our projection -> the checkpoint's name prefix of expert `expert`'s weight."""
    if arch == "mixtral":  # the original checkpoints' names
        base = f"{layer_prefix}.block_sparse_moe.experts.{expert}"
        return {"gate": f"{base}.w1", "up": f"{base}.w3", "down": f"{base}.w2"}
    base = f"{layer_prefix}.mlp.experts.{expert}"
    return {"gate": f"{base}.gate_proj", "up": f"{base}.up_proj", "down": f"{base}.down_proj"}


def _moe_checkpoint(tmp_path, arch: str, method: str, group: int):
    """A directory holding `hf`'s projections (experts per expert, attention, dense MLP)
    quantized in `method`'s layout; `hf` gets the same weights dequantized."""
    hf = _tiny_moe(arch)
    tensors = {}
    for name, tensor in hf.state_dict().items():
        layer_prefix, sep, leaf = name.partition(".mlp.experts.")
        if sep:  # transformers 5's stacked experts: gate_up_proj [E, 2I, H], down [E, H, I]
            for e in range(NUM_EXPERTS):
                names = _expert_names(arch, layer_prefix, e)
                parts = ({"gate": tensor[e, :MOE_INTER], "up": tensor[e, MOE_INTER:]}
                         if leaf == "gate_up_proj" else {"down": tensor[e]})
                for proj, weight in parts.items():
                    _quantize_into(tensors, names[proj], weight, method, group)
            continue
        prefix = name.removesuffix(".weight")
        if prefix.endswith(LINEARS):
            _quantize_into(tensors, prefix, tensor, method, group)
        else:
            tensors[name] = tensor.clone()
    if method == "fp8":
        config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]}
    else:
        config = {"quant_method": method, "bits": 4, "group_size": group}
        config.update({"version": "gemm", "zero_point": True} if method == "awq" else
                      {"desc_act": False, "sym": False, "checkpoint_format": "gptq"})
    hf.config.quantization_config = config
    hf.config.save_pretrained(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return hf


def _moes(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _dequantized_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "dequantized at load" in r.getMessage()]


@pytest.mark.parametrize(
    "arch, method, group",
    [("qwen3_moe", "awq", 32), ("qwen3_moe", "gptq", 128), ("qwen3_moe", "awq", 64),
     ("mixtral", "gptq", 64), ("qwen3_moe", "fp8", 0)],
)
def test_quantized_experts_match_transformers(tmp_path, caplog, arch, method, group):
    hf = _moe_checkpoint(tmp_path, arch, method, group)
    with caplog.at_level("INFO"):
        detected, model = _load(tmp_path)
    assert detected == method
    moes = _moes(model)
    assert len(moes) == (1 if arch == "qwen3_moe" else 2)
    codes_dtype = torch.float8_e4m3fn if method == "fp8" else torch.uint8
    for moe in moes:
        assert isinstance(moe.scheme, QuantizedExperts)
        params = dict(moe.named_parameters())
        assert "w13" not in params and "w2" not in params  # no dense copy of the experts
        assert moe.w13_codes.dtype == codes_dtype and moe.w2_codes.dtype == codes_dtype
        held = sum(p.numel() * p.element_size() for n, p in params.items()
                   if n.startswith(("w13_", "w2_")))
        dense_fp32 = NUM_EXPERTS * 3 * MOE_INTER * HIDDEN * 4
        # int4: half a byte a weight plus scales and offsets; FP8 one byte plus a scale
        # per row of each 128-column block
        assert held < dense_fp32 * (0.3 if method == "fp8" else 0.2)
        assert isinstance(moe._apply_packed, PackedExperts)
        linears = [f for pair in moe._apply_packed.linears for f in pair]
        assert len(linears) == 2 * NUM_EXPERTS
        if method != "fp8":  # the cpu plugin's int4 kernel, not the reference
            assert all(isinstance(f, cpu_ops.Int4QuantizedLinear) for f in linears)
    assert _dequantized_logs(caplog) == []  # nothing quantized went to a dense layer
    got, want = _logits(model, hf)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_quantization_none_keeps_the_dense_experts(tmp_path, caplog):
    hf = _moe_checkpoint(tmp_path, "qwen3_moe", "awq", 64)
    with caplog.at_level("INFO"):
        detected, model = _load(tmp_path, "none")
    assert detected == "none"
    (moe,) = _moes(model)
    assert isinstance(moe.scheme, DenseWeights) and moe.w13.dtype == torch.float32
    assert moe._apply_packed is None  # the op moe_experts, as before quantization
    assert len(_dequantized_logs(caplog)) == 1
    got, want = _logits(model, hf)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_quantized_experts_refuse_expert_parallel():
    tp = GroupCoordinator("tp", (0, 1), 0, None)
    parallel = ParallelState(ParallelLayout.of(tp=2), 0, {"tp": tp}, expert_parallel=True)
    quant = QuantScheme("awq", "int4", bits=4, group_size=32)
    experts = QuantizedExperts(quant, quant, torch.float32)
    build = LayerBuilder(ops=load_platform("cpu").ops, dtype=torch.float32, parallel=parallel,
                         schemes=lambda prefix: experts)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp: QuantizedExperts experts "
                                         r"are not split over ranks yet \(expert parallel "
                                         r"size 2, MoE tensor parallel size 1\)"):
        FusedMoE(hidden_size=64, intermediate_size=32, num_experts=4, top_k=2,
                 routing="softmax_topk", renormalize=True, activation="silu",
                 router_bias=False, expert_bias=False, build=build, prefix="model.layers.0.mlp")


def _gguf_moe(path, type_name: str, experts_type: str):
    """A GGUF file of a tiny Qwen3-MoE (every layer sparse: llama.cpp's qwen3moe has no
    dense layer) whose projections are in `type_name` and stacked experts (`ffn_*_exps`,
    llama.cpp's layout) in `experts_type`, quantized by the gguf package (F32: float);
    the HF model gets the same weights dequantized by gguf."""
    from gguf import GGMLQuantizationType, GGUFWriter, dequantize, quantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        get_gguf_hf_weights_map,
    )

    from tokenmill.model.gguf_quant import ParameterNames

    hf = _tiny_moe("qwen3_moe", mlp_only_layers=[])
    state = hf.state_dict()
    processor = TENSOR_PROCESSORS["qwen3moe"](config=hf.config.to_dict())
    name_map = get_gguf_hf_weights_map(ParameterNames(hf.config, list(state)), processor)
    writer = GGUFWriter(str(path), "qwen3moe")
    for gguf_name, hf_name in name_map.items():
        tensor = state[hf_name]
        if gguf_name.endswith("_exps"):  # [E, 2I, H] gate then up, or [E, H, I]
            proj = gguf_name.rpartition("_")[0].rpartition("_")[2]
            tensor = {"gate": tensor[:, :MOE_INTER], "up": tensor[:, MOE_INTER:]}.get(
                proj, tensor)
            gguf_name += ".weight"
            if experts_type == "F32":
                writer.add_tensor(gguf_name, tensor.numpy().copy())
                continue
        elif not gguf_name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                     "attn_output.weight", "output.weight")):
            writer.add_tensor(gguf_name, tensor.numpy().copy())
            continue
        kind = getattr(GGMLQuantizationType,
                       experts_type if gguf_name.endswith("_exps.weight") else type_name)
        raw = quantize(tensor.numpy(), kind)
        tensor.copy_(torch.from_numpy(dequantize(raw, kind)))
        writer.add_tensor(gguf_name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.mark.parametrize("type_name, experts_type",
                         [("Q4_0", "Q4_0"), ("Q8_0", "Q8_0"), ("Q4_0", "F32")])
def test_gguf_stacked_experts_stay_quantized(tmp_path, caplog, type_name, experts_type):
    """llama.cpp's 3-D `ffn_*_exps` tensors read expert by expert into QuantizedExperts:
    Q4_0 on the cpu int4 kernel, Q8_0 on the reference (logged); float experts (F32)
    into the dense experts, expert by expert too."""
    from tokenmill.model.loader import build_model, checkpoint_weights, quant_schemes
    from tokenmill.platforms.ops.reference import ReferenceAttentionBackend

    path = tmp_path / "moe.gguf"
    hf = _gguf_moe(path, type_name, experts_type)
    with caplog.at_level("INFO"):
        model = build_model(
            hf.config, checkpoint_weights(str(path), hf.config, quantization="gguf"),
            dtype=torch.float32, device="cpu", ops=load_platform("cpu").ops,
            attention_backend=ReferenceAttentionBackend(), block_size=4,
            schemes=quant_schemes(str(path), hf.config, "gguf", torch.float32))
    moes = _moes(model)
    assert len(moes) == 2
    if experts_type == "F32":
        assert all(isinstance(m.scheme, DenseWeights) for m in moes)
    else:
        assert all(isinstance(m.scheme, QuantizedExperts) for m in moes)
        assert all(m.w13_codes.dtype == torch.uint8
                   and "w13" not in dict(m.named_parameters()) for m in moes)
        linears = [f for m in moes for pair in m._apply_packed.linears for f in pair]
        if experts_type == "Q4_0":
            assert all(isinstance(f, cpu_ops.Int4QuantizedLinear) for f in linears)
    assert _dequantized_logs(caplog) == []
    got, want = _logits(model, hf)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
