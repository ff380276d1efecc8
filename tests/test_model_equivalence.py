"""Our model graph and loaders against HF transformers.

Tiny randomly initialised checkpoints of every supported architecture are saved with
`save_pretrained`, loaded with our loader and run over a paged KV cache with the reference
backend; every logit must match transformers' own forward over the whole sequence, whatever
the split into steps (one step, chunked prefill, ragged batches, decode).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_harness import PagedHarness
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tokenmill.model.loader import LoadedModel, default_model_path, load_model_and_tokenizer
from tokenmill.platforms.interfaces import AttentionKind
from tokenmill.platforms.ops import resolve_ops
from tokenmill.platforms.ops.reference import ReferenceAttentionBackend

VOCAB = 256
EOS_ID = 250
BLOCK_SIZE = 4
ATOL = 1e-4
CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}"

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # large enough that every weight visibly moves the logits
    eos_token_id=1,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=False),
    # Tied head and Llama 3.1 frequency scaling; a small original context puts some of the
    # 8 frequencies in each of the three bands (kept, smoothed, divided).
    "llama3_rope_tied": lambda: LlamaConfig(
        **_COMMON,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2": lambda: Qwen2Config(**_COMMON, tie_word_embeddings=False),
    # layer 0 full attention, layer 1 a window of 4 tokens
    "qwen2_sliding": lambda: Qwen2Config(
        **_COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1
    ),
    # head_dim 32 is not hidden / heads (16): the config's head_dim must win
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True),
    # window 4 then global; global rope linearly scaled; logits soft-capped
    "gemma3": lambda: Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 3},
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=30.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    ),
    # window 4 then global, sinks, 4 experts (top 2), YaRN with a small original context
    "gpt_oss": lambda: GptOssConfig(
        **{**_COMMON, "intermediate_size": 32},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
            "rope_theta": 150000.0,
        },
    ),
    # 4 experts (top 2, renormalised), q/k norm; layer 1 dense
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
    ),
    # 4 experts, top 2, every layer sparse
    "mixtral": lambda: MixtralConfig(
        **{**_COMMON, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
}


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(VOCAB) if i != EOS_ID}
    vocab["<eos>"] = EOS_ID
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _make_checkpoint(name: str, path: Path, **save_kwargs) -> torch.nn.Module:
    """Save a seeded random HF model `name` (and a tokenizer) to `path`; return it, float32."""
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        # HF initialises norms to 1 (Gemma: 0) and biases to 0; randomise them so loading
        # them matters.
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif param_name.endswith("bias") or param_name.endswith(".sinks"):
                param.copy_(0.2 * torch.randn_like(param))
    model.generation_config = GenerationConfig(eos_token_id=[1, 3])
    model.save_pretrained(path, **save_kwargs)
    _tiny_tokenizer().save_pretrained(path)
    return model


def _load(path: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    return load_model_and_tokenizer(
        str(path),
        dtype=dtype,
        device="cpu",
        ops=resolve_ops(),
        attention_backend=ReferenceAttentionBackend(),
        block_size=BLOCK_SIZE,
    )


@torch.inference_mode()
def _hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, LoadedModel]:
    """(HF model, our loaded model) of one tiny architecture."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = _make_checkpoint(request.param, path)
    return hf_model, _load(path)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(hf_model: torch.nn.Module, seq, got: torch.Tensor) -> None:
    want = _hf_logits(hf_model, seq.token_ids)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_one_step(pair):
    hf_model, loaded = pair
    harness = PagedHarness(loaded.model, ReferenceAttentionBackend())
    seq = harness.add(_tokens(11, seed=1))
    _check(hf_model, seq, harness.run([[(seq, 11)]])[id(seq)])


def test_chunked_prefill_reads_the_cache(pair):
    hf_model, loaded = pair
    harness = PagedHarness(loaded.model, ReferenceAttentionBackend())
    seq = harness.add(_tokens(13, seed=2))
    logits = harness.run([[(seq, 5)], [(seq, 6)], [(seq, 2)]])[id(seq)]
    _check(hf_model, seq, logits)


def test_ragged_batch_with_decode(pair):
    """Two sequences of different lengths share every step: prefill chunks beside decodes."""
    hf_model, loaded = pair
    harness = PagedHarness(loaded.model, ReferenceAttentionBackend())
    a = harness.add(_tokens(18, seed=3))
    b = harness.add(_tokens(10, seed=4))
    schedule = [
        [(a, 7), (b, 3)],
        [(b, 3), (a, 6)],  # order within a step does not matter
        [(a, 1), (b, 1)],
        [(a, 1), (b, 1)],
        [(b, 1), (a, 1)],
        [(a, 1)],
        [(a, 1), (b, 1)],
    ]
    logits = harness.run(schedule)
    _check(hf_model, a, logits[id(a)])
    _check(hf_model, b, logits[id(b)])


def test_loaded_metadata(pair):
    hf_model, loaded = pair
    assert loaded.eos_token_ids == {1, 3, EOS_ID}  # config | generation config | tokenizer
    assert loaded.chat_template == CHAT_TEMPLATE
    assert loaded.max_model_len == 128
    assert loaded.tokenizer.convert_tokens_to_ids(["t7", "<eos>"]) == [7, EOS_ID]
    layer_types = getattr(hf_model.config, "layer_types", None) or ["full_attention"] * 2
    kinds = [s.kind for s in loaded.model.attention_specs]
    assert kinds == [
        AttentionKind.SLIDING_WINDOW if t == "sliding_attention" else AttentionKind.FULL
        for t in layer_types
    ]


def test_sharded_safetensors(tmp_path):
    hf_model = _make_checkpoint("qwen2", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    harness = PagedHarness(_load(tmp_path).model, ReferenceAttentionBackend())
    seq = harness.add(_tokens(8, seed=5))
    _check(hf_model, seq, harness.run([[(seq, 8)]])[id(seq)])


def test_bfloat16_is_close(tmp_path):
    """bf16 weights and activations stay near the float32 reference (loose: bf16 has 8 bits)."""
    hf_model = _make_checkpoint("llama", tmp_path)
    loaded = _load(tmp_path, dtype=torch.bfloat16)
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    harness = PagedHarness(loaded.model, ReferenceAttentionBackend())
    seq = harness.add(_tokens(10, seed=6))
    got = harness.run([[(seq, 6)], [(seq, 4)]])[id(seq)]
    want = _hf_logits(hf_model, seq.token_ids)
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def _rewrite_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_weight_is_named(tmp_path):
    _make_checkpoint("llama", tmp_path)
    _rewrite_weights(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        _load(tmp_path)


def test_unknown_weight_is_named(tmp_path):
    _make_checkpoint("llama", tmp_path)
    _rewrite_weights(tmp_path, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(KeyError, match=r"model\.extra\.weight"):
        _load(tmp_path)


def test_unsupported_model_type_is_named(tmp_path):
    _make_checkpoint("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'gpt2'.*llama.*qwen2.*qwen3"):
        _load(tmp_path)


def test_missing_model_path_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _load(tmp_path / "nowhere")


@pytest.mark.slow
@pytest.mark.long  # a minute: the 135M model in transformers and here
def test_default_gguf_matches_transformers():
    """The shipped SmolLM2 GGUF: our logits against transformers' own GGUF loading."""
    path = Path(default_model_path())
    loaded = load_model_and_tokenizer(
        str(path),
        dtype=torch.float32,
        device="cpu",
        ops=resolve_ops(),
        attention_backend=ReferenceAttentionBackend(),
        block_size=16,
    )
    assert loaded.hf_config.model_type == "llama"
    assert 2 in loaded.eos_token_ids  # <|im_end|>, the chat turn's end
    assert loaded.chat_template and "<|im_start|>" in loaded.chat_template
    assert loaded.max_model_len == 8192

    token_ids = loaded.tokenizer("The capital of France is")["input_ids"]
    harness = PagedHarness(loaded.model, ReferenceAttentionBackend(), num_blocks=8)
    seq = harness.add(token_ids)
    got = harness.run([[(seq, len(token_ids) - 2)], [(seq, 2)]])[id(seq)]

    hf_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    want = _hf_logits(hf_model, token_ids)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    assert got[-1].argmax() == want[-1].argmax()
    # independent of transformers' GGUF reading (it shares our dequantization and the q/k
    # un-permutation): a model that loaded right knows this
    assert loaded.tokenizer.decode(got[-1].argmax().item()).strip() == "Paris"
