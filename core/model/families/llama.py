"""Decoder-only transformer for the HF model types "llama", "qwen2" and "qwen3".

The three differ only in small switches, read from the HF config:

| model_type | q/k/v bias          | o_proj bias         | q/k per-head norm | head_dim          |
|------------|---------------------|---------------------|-------------------|-------------------|
| llama      | attention_bias      | attention_bias      | no                | head_dim or h / n |
| qwen2      | always              | never               | no                | h / n             |
| qwen3      | attention_bias      | attention_bias      | yes               | head_dim          |

Parameter names follow HF's, except that q/k/v become `qkv_proj` and gate/up become
`gate_up_proj`; `load_weights` merges them. Its decoder layer is the base of the other
families with llama attention (gpt-oss, Mixtral, Qwen3-MoE), which override `_make_mlp`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tokenmill.model.base import CausalLM, DecoderModel, attention_specs
from tokenmill.model.draft import DraftBase, eagle3_aux_layers, eagle3_specs, head_logits
from tokenmill.model.family import ModelFamily, shrink_config
from tokenmill.model.layers import (
    Attention,
    BackendChoice,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    add_norm,
    resolve_backends,
    rotary_from_config,
)
from tokenmill.model.linear import LayerBuilder
from tokenmill.platforms.interfaces import AttentionBackend, AttentionMetadata, AttentionSpec


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream rides alongside so norms can fuse the add."""

    def __init__(
        self, hf_config: Any, spec: AttentionSpec, rotary: RotaryEmbedding,
        backend: AttentionBackend, build: LayerBuilder, prefix: str, layer_index: int = 0,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index  # before _make_mlp: a family may choose by layer
        model_type = hf_config.model_type
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = Attention(
            hidden_size=hidden,
            spec=spec,
            rotary=rotary,
            backend=backend,
            build=build,
            prefix=f"{prefix}.self_attn",
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            qk_norm_eps=eps if self.qk_norm(hf_config) else None,
        )
        self.mlp = self._make_mlp(hf_config, build, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hidden, eps, build.ops, build.dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, build.ops, build.dtype)

    def qk_norm(self, hf_config: Any) -> bool:
        """Whether attention normalises each head's q and k (Qwen3's)."""
        return hf_config.model_type == "qwen3"

    def _make_mlp(self, hf_config: Any, build: LayerBuilder, prefix: str) -> nn.Module:
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, mlp_bias, build, prefix)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Model(DecoderModel):
    """Embedding, decoder layers (`layer_cls`), final norm (HF's `model.` prefix)."""

    layer_cls: type[DecoderLayer] = DecoderLayer

    def setup(self, hf_config: Any, specs: list[AttentionSpec], build: LayerBuilder) -> None:
        self.rotary_emb = rotary_from_config(hf_config, build.ops)

    def make_layer(
        self, hf_config: Any, index: int, spec: AttentionSpec, backend: AttentionBackend,
        build: LayerBuilder, prefix: str,
    ) -> nn.Module:
        return self.layer_cls(hf_config, spec, self.rotary_emb, backend, build, prefix,
                              layer_index=index)


class LlamaForCausalLM(CausalLM):
    """A llama / qwen2 / qwen3 causal LM over a paged KV cache."""

    body_cls = Model


def tiny(hf_config: Any) -> Any:
    """Two small layers; q/k/v of 4 query and 2 KV heads."""
    return shrink_config(
        hf_config, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    )


# ---- EAGLE-3 --------------------------------------------------------------------------------
class Eagle3Layer(DecoderLayer):
    """A llama layer whose attention reads [embeds, hidden] (2 x hidden wide)."""

    def __init__(self, hf_config: Any, spec: AttentionSpec, rotary: RotaryEmbedding,
                 backend: nn.Module, build: LayerBuilder, prefix: str) -> None:
        super().__init__(hf_config, spec, rotary, backend, build, prefix)
        hidden = hf_config.hidden_size
        attn = self.self_attn
        bias = bool(getattr(hf_config, "attention_bias", False))
        attn.qkv_proj = build.column(
            f"{prefix}.self_attn.qkv_proj", 2 * hidden, attn.qkv_sizes(), bias,
            shards=build.attention_shards(attn.q_size, spec.head_size), gather=True,
        )
        self.hidden_norm = RMSNorm(hidden, hf_config.rms_norm_eps, build.ops, build.dtype)

    def predict(self, embeds, hidden, positions, kv_cache, metadata):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(positions, x, kv_cache, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Draft(DraftBase, LlamaForCausalLM):
    """An EAGLE-3 draft head for a llama-family target (see the module docstring)."""

    def __init__(self, draft_config: Any, target_config: Any, build: LayerBuilder,
                 attention_backend: BackendChoice, block_size: int) -> None:
        nn.Module.__init__(self)
        self._init_loading(draft_config, build)
        hidden = draft_config.hidden_size
        self.aux_layers = eagle3_aux_layers(draft_config, target_config)
        target_hidden = getattr(draft_config, "target_hidden_size", None) or target_config.hidden_size
        self.attention_specs = eagle3_specs(draft_config, build.dtype, block_size)
        self.layer_backends = resolve_backends(self.attention_specs, attention_backend)
        self.rotary_emb = rotary_from_config(draft_config, build.ops)
        self.midlayer = Eagle3Layer(draft_config, self.attention_specs[0], self.rotary_emb,
                                    self.layer_backends[0], build, "midlayer")
        self.fc = build.replicated("fc", len(self.aux_layers) * target_hidden, hidden, False)
        self.norm = RMSNorm(hidden, draft_config.rms_norm_eps, build.ops, build.dtype)
        self.draft_vocab_size = getattr(draft_config, "draft_vocab_size", None) or \
            target_config.vocab_size
        self.lm_head = build.lm_head("lm_head", hidden, self.draft_vocab_size)
        self.embed_tokens: nn.Module | None = None  # the target's unless the checkpoint has one
        self._own_embed = build.embedding("embed_tokens", target_config.vocab_size, hidden)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64),
                             persistent=False)
        self._loaded_embed = False
        self.requires_grad_(False)

    def _convert(self, hf_name: str, tensor: torch.Tensor):
        name = re.sub(r"^(model\.)?layers\.0\.", "midlayer.", hf_name)
        name = name.removeprefix("model.")
        if name == "d2t":
            self.d2t.copy_(tensor.to(torch.int64))
            return
        if name == "t2d":
            return  # the target -> draft map; drafting needs only d2t
        if name == "embed_tokens.weight":
            name, self._loaded_embed = "_own_embed.weight", True
        yield from super()._convert(name, tensor)

    def load_weights(self, weights) -> None:
        """The checkpoint's weights; an embedding it lacks is the target's (`attach`)."""
        weights = list(weights)
        names = {n for n, _ in weights}
        if not any(n.endswith("embed_tokens.weight") for n in names):
            del self._own_embed  # shared with the target, set by share_embedding
        super().load_weights(weights)
        if self._loaded_embed:
            self.embed_tokens = self._own_embed

    def attach(self, target: nn.Module) -> None:
        """The target's embedding, unless the checkpoint had one."""
        if self.embed_tokens is None:
            self.__dict__["embed_tokens"] = target.model.embed_tokens  # not a submodule

    def first_hidden(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat(aux, dim=-1))

    def forward(self, input_ids, positions, hidden, kv_caches, metadata):
        embeds = self.embed_tokens(input_ids)
        x, residual = self.midlayer.predict(embeds, hidden, positions, kv_caches[0], metadata)
        normed, prenorm = self.norm(x, residual)
        return normed, prenorm

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = head_logits(self.lm_head, hidden, self.draft_vocab_size, self.tp).argmax(dim=-1)
        return ids + self.d2t[ids]


FAMILY = ModelFamily(
    eagle3=Eagle3Draft,
    name="llama",
    model_types=("llama", "qwen2", "qwen3"),
    model=LlamaForCausalLM,
    attention_specs=attention_specs,
    tiny=tiny,
)
