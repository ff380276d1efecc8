"""Model-based speculative decoding end to end through `LLM` on the CPU plugin: greedy
outputs with DeepSeek-V3's MTP module (`mtp`) and with an EAGLE-3 draft head on llama
(`eagle3`, a tiny random head with a reduced draft vocabulary) equal those without
speculation, batched, one by one, with prefix-cache hits and under preemption; the
acceptance counters are kept per method. Draft weights are random: the test checks
exactness (drafts are verified), the drafts' quality is what it is.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, Qwen3NextConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

from tokenmill import LLM, SamplingParams
from tokenmill_conformance.tiny_models import make_tiny_model

pytestmark = pytest.mark.long  # draft models on DeepSeek-V3 and Qwen3-Next, minutes on 2 cores

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over",
    "def main():\n    return 42\ndef main():\n    return",
    "Paris is the capital of France; Berlin is the capital of Germany. Paris is",
    "hello",
]
# few tokens: a tiny DeepSeek-V3 step takes most of a second on a loaded 2-core machine
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _random(shape, generator, std=0.15):
    return torch.randn(shape, generator=generator) * std


def add_mtp_module(path, seed: int = 1):
    """Give a tiny DeepSeek-V3 checkpoint one random MTP module (`model.layers.{N}.*`,
    as DeepSeek-V3's checkpoint lays it out)."""
    config = DeepseekV3Config.from_pretrained(path)
    n, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    torch.manual_seed(seed)
    layer = DeepseekV3DecoderLayer(config, layer_idx=n)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in layer.state_dict().items():
        tensors[f"model.layers.{n}.{name}"] = _random(p.shape, g) if p.dim() > 1 else p.clone()
    for name, shape in (("embed_tokens.weight", (vocab, hidden)),
                        ("eh_proj.weight", (hidden, 2 * hidden)),
                        ("shared_head.head.weight", (vocab, hidden))):
        tensors[f"model.layers.{n}.{name}"] = _random(shape, g)
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        tensors[f"model.layers.{n}.{name}"] = torch.ones(hidden)
    weights = load_file(path / "model.safetensors")
    weights.update({k: v.contiguous() for k, v in tensors.items()})
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def add_qwen3_next_mtp(path, seed: int = 3):
    """Give a tiny Qwen3-Next checkpoint one random MTP module (`mtp.*`: fc, the
    pre-fc norms, a gated full-attention MoE layer, the final norm), as Qwen3-Next's
    checkpoint lays it out, and declare it in config.json."""
    config_path = path / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(cfg))
    config = Qwen3NextConfig.from_pretrained(path)
    full = config.layer_types.index("full_attention")
    torch.manual_seed(seed)
    layer = Qwen3NextDecoderLayer(config, layer_idx=full)
    g = torch.Generator().manual_seed(seed)
    tensors = {f"mtp.layers.0.{name}": _random(p.shape, g) if p.dim() > 1 else p.clone()
               for name, p in layer.state_dict().items()}
    hidden = config.hidden_size
    tensors["mtp.fc.weight"] = _random((hidden, 2 * hidden), g)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.zeros(hidden)  # (1 + w) norms
    weights = load_file(path / "model.safetensors")
    weights.update({k: v.contiguous() for k, v in tensors.items()})
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def make_eagle3_head(path, target, seed: int = 2):
    """A random EAGLE-3 head for the tiny llama `target`, its draft vocabulary half the
    target's (`d2t` maps draft ids to target ids)."""
    cfg = json.loads((target / "config.json").read_text())
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], 16
    inter, draft_vocab = cfg["intermediate_size"], vocab // 2
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-5,
        "max_position_embeddings": cfg["max_position_embeddings"], "torch_dtype": "float32",
    }))
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "midlayer.self_attn.q_proj.weight": _random((heads * head_dim, 2 * hidden), g),
        "midlayer.self_attn.k_proj.weight": _random((kv_heads * head_dim, 2 * hidden), g),
        "midlayer.self_attn.v_proj.weight": _random((kv_heads * head_dim, 2 * hidden), g),
        "midlayer.self_attn.o_proj.weight": _random((hidden, heads * head_dim), g),
        "midlayer.mlp.gate_proj.weight": _random((inter, hidden), g),
        "midlayer.mlp.up_proj.weight": _random((inter, hidden), g),
        "midlayer.mlp.down_proj.weight": _random((hidden, inter), g),
        "fc.weight": _random((hidden, 3 * hidden), g),
        "lm_head.weight": _random((draft_vocab, hidden), g),
    }
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm",
                 "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{name}.weight"] = torch.ones(hidden)
    kept = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    tensors["d2t"] = kept - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    tensors["t2d"] = t2d
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_models")
    deepseek = add_mtp_module(make_tiny_model(root / "deepseek_v3", "deepseek_v3"))
    llama = make_tiny_model(root / "llama", "llama")
    qwen3_next = add_qwen3_next_mtp(make_tiny_model(root / "qwen3_next", "qwen3_next"))
    return {"mtp": (deepseek, None), "mtp-qwen3_next": (qwen3_next, None),
            "eagle3": (llama, make_eagle3_head(root / "eagle3", llama))}


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


# per case: a pool small enough that the prompts preempt each other (blocks of 4)
TIGHT_BLOCKS = {"mtp": 20, "mtp-qwen3_next": 160, "eagle3": 20}


@pytest.mark.parametrize("case", list(TIGHT_BLOCKS))
def test_greedy_identity_model_drafts(models, case):
    """mtp on DeepSeek-V3 (an MLA + MoE module) and on Qwen3-Next (a gated attention
    layer that adds a KV group to the hybrid's), eagle3 on llama."""
    method = case.split("-")[0]
    target, head = models[case]
    path = str(target)
    base = LLM(path, dtype="float32", block_size=4)
    want = _tokens(base.generate(PROMPTS, GREEDY, use_tqdm=False))
    base.engine.shutdown()
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if head is not None:
        spec["model"] = str(head)
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=TIGHT_BLOCKS[case],
              max_num_batched_tokens=64, speculative_config=spec)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    for _ in range(2):  # alone, then again: a prefix-cache hit
        assert _tokens(llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)) == want[1:2]
    assert llm.engine.kv.stats.hits > 0
    stats = llm.engine.spec.drafter.stats
    assert llm.engine.scheduler_stats().spec.method == method
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens <= stats.num_draft_tokens
    assert llm.engine.kv.usage == 0.0  # every block, scratch and lookahead ones, came back
    llm.engine.shutdown()


def test_seeded_sampling_is_the_same_with_eagle3(models):
    """Model drafts are proposed with certainty: the verifier's coupling keeps a seeded
    request's output exactly the one without speculation (docs/speculative.md)."""
    target, head = models["eagle3"]
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12, ignore_eos=True)
    base = LLM(str(target), dtype="float32", block_size=4)
    want = _tokens(base.generate(PROMPTS, params, use_tqdm=False))
    base.engine.shutdown()
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "adaptive": False,
            "model": str(head)}
    llm = LLM(str(target), dtype="float32", block_size=4, speculative_config=spec)
    assert _tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == want
    assert llm.engine.spec.drafter.stats.num_draft_tokens > 0
    llm.engine.shutdown()


def test_model_methods_refuse_what_they_cannot_run(models):
    llama, head = models["eagle3"]
    with pytest.raises(ValueError, match="'mtp' runs the MTP module"):
        LLM(str(llama), dtype="float32", speculative_config={
            "method": "mtp", "num_speculative_tokens": 2})
    deepseek, _ = models["mtp"]
    with pytest.raises(ValueError, match="'eagle3' drafts for targets of \\['llama'"):
        LLM(str(deepseek), dtype="float32", speculative_config={
            "method": "eagle3", "num_speculative_tokens": 2, "model": str(head)})
