"""Tiny randomly initialised HF models (with a real tokenizer) built in code, no hub.

One per architecture variant the core supports; tier T3 runs them on the plugin and on
the reference platform. The core's tests/tiny_models.py uses them too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    DeepseekV3Config,
    Gemma3TextConfig,
    GptOssConfig,
    KimiLinearConfig,
    LlamaConfig,
    MixtralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "héllo wörld, naïve café, 你好世界 🙂",
    "def main():\n    return 42\n",
    "tokenmill turns any accelerator into tokens, one step at a time.",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config(arch: str, vocab_size: int):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=arch not in ("qwen2", "gemma3"),
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=0,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "llama3":
        return LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=32)
    if arch == "qwen3_h128":
        # production attention shapes: head size 128, 8 query heads over 2 KV heads (GQA 4)
        # positions for T3's prompts of two 256-token blocks and the tokens decoded after
        return Qwen3Config(**{**common, "num_attention_heads": 8, "max_position_embeddings": 1024},
                           head_dim=128)
    if arch == "gemma3":
        # a sliding layer (window 8, shorter than most prompts) then a global one, each
        # with its own rotary base, as Gemma 3 interleaves them
        return Gemma3TextConfig(
            **common, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
        )
    if arch == "gpt_oss":
        # a sliding layer (window 8) then a global one, both with sinks; 4 experts, top 2;
        # YaRN over a small original context
        return GptOssConfig(
            **{**common, "intermediate_size": 32}, head_dim=16, sliding_window=8,
            num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0,
            },
        )
    if arch == "qwen3_moe":
        # 4 experts of 32, top 2 renormalised; layer 1 keeps a dense MLP
        return Qwen3MoeConfig(
            **common, head_dim=16, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        )
    if arch == "mixtral":
        return MixtralConfig(
            **{**common, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
        )
    if arch == "deepseek_v3":
        # MLA (latent KV, a q LoRA, a decoupled rope key), one dense layer then MoE with a
        # shared expert and group-limited sigmoid routing (4 groups of 2, top 2 groups)
        return DeepseekV3Config(
            **{**common, "num_hidden_layers": 3, "num_key_value_heads": 4},
            moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8, n_group=4,
            topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
            routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        )
    if arch == "qwen3_next":
        # Gated DeltaNet layers (recurrent state) then gated full attention, MoE with a
        # shared expert and one dense layer
        return Qwen3NextConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=16,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        )
    if arch == "kimi_linear":
        # Kimi Delta Attention (recurrent state) and MLA layers interleaved, one dense layer
        # then MoE with a shared expert
        return KimiLinearConfig(
            **{**common, "num_hidden_layers": 4, "num_key_value_heads": 4},
            moe_intermediate_size=32, n_shared_experts=1, num_local_experts=8, n_group=1,
            topk_group=1, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4},
            layer_types=["linear_attention", "full_attention"] * 2,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        )
    if arch == "bamba":
        # a Mamba2 layer then a full-attention one; SSD chunks of 8, so prompts span several
        return BambaConfig(
            **common, attn_layer_indices=[1], mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
        )
    raise ValueError(arch)


def make_tiny_model(path: Path, arch: str, seed: int = 0) -> Path:
    """Save a tiny random `arch` model with a trained byte-level BPE tokenizer in `path`."""
    tokenizer = make_tokenizer(300)
    config = make_config(arch, len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger weights than the default init give peaked distributions, so greedy
    # comparisons are not decided by float noise between near-equal logits.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Tier T3's production-shaped variant (head size 128, GQA 4), beside the per-type ones.
PRODUCTION_VARIANTS = ("qwen3_h128",)
# HF model_type -> the tiny variants that cover it (llama3 differs by its rope scaling).
VARIANTS = {
    "llama": ("llama", "llama3"),
    "qwen2": ("qwen2",),
    "qwen3": ("qwen3",),
    "gemma3_text": ("gemma3",),
    "gpt_oss": ("gpt_oss",),
    "qwen3_moe": ("qwen3_moe",),
    "mixtral": ("mixtral",),
    "deepseek_v3": ("deepseek_v3",),
    "qwen3_next": ("qwen3_next",),
    "kimi_linear": ("kimi_linear",),
    "bamba": ("bamba",),
}
