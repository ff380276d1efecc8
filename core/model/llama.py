"""Decoder-only transformer for the HF model types "llama", "qwen2" and "qwen3".

The three differ only in small switches, read from the HF config:

| model_type | q/k/v bias          | o_proj bias         | q/k per-head norm | head_dim          |
|------------|---------------------|---------------------|-------------------|-------------------|
| llama      | attention_bias      | attention_bias      | no                | head_dim or h / n |
| qwen2      | always              | never               | no                | h / n             |
| qwen3      | attention_bias      | attention_bias      | yes               | head_dim          |

Parameter names follow HF's, except that q/k/v become `qkv_proj` and gate/up become
`gate_up_proj`; `load_weights` merges them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import get_parallel_state
from tokenmill.kv.groups import KVLayout, plan_groups
from tokenmill.model import parallel, pipeline, prefill_context_parallel
from tokenmill.model.context_parallel import (
    DecodeContextParallelAttention,
    check_decode_context_parallel,
)
from tokenmill.model.layers import (
    Attention,
    BackendChoice,
    Embedding,
    GatedMLP,
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    resolve_backends,
    rope_parameters,
)
from tokenmill.model.prefill_context_parallel import PrefillContextParallelAttention
from tokenmill.ops import Ops
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)

logger = logging.getLogger(__name__)

# model types whose attention normalises each head's q and k (Qwen3 and its MoE)
QK_NORM_TYPES = ("qwen3", "qwen3_moe")

# HF projection name -> (fused module name, shard index within it)
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def attention_specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    """One spec per layer; a layer is SLIDING_WINDOW when `layer_types` marks it so."""
    num_heads = hf_config.num_attention_heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    num_layers = hf_config.num_hidden_layers
    layer_types = getattr(hf_config, "layer_types", None) or ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config has {len(layer_types)} layer_types for {num_layers} layers: {layer_types}"
        )
    window = getattr(hf_config, "sliding_window", None)
    specs = []
    for i, layer_type in enumerate(layer_types):
        if layer_type not in ("full_attention", "sliding_attention"):
            raise ValueError(
                f"layer {i} has layer type {layer_type!r}; only full_attention and "
                "sliding_attention layers are supported"
            )
        sliding = layer_type == "sliding_attention" and window is not None
        specs.append(
            AttentionSpec(
                kind=AttentionKind.SLIDING_WINDOW if sliding else AttentionKind.FULL,
                num_heads=num_heads,
                num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
                head_size=head_size,
                dtype=dtype,
                block_size=block_size,
                sliding_window=window if sliding else None,
            )
        )
    return specs


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream rides alongside so norms can fuse the add."""

    def __init__(
        self,
        hf_config: Any,
        spec: AttentionSpec,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        ops: Ops,
        dtype: torch.dtype,
        layer_index: int = 0,
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
            ops=ops,
            dtype=dtype,
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            qk_norm_eps=eps if model_type in QK_NORM_TYPES else None,
        )
        self.mlp = self._make_mlp(hf_config, ops, dtype)
        self.input_layernorm = RMSNorm(hidden, eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops, dtype)

    def _make_mlp(self, hf_config: Any, ops: Ops, dtype: torch.dtype) -> nn.Module:
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, mlp_bias, ops, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Model(nn.Module):
    """Embedding, decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(
        self,
        hf_config: Any,
        specs: list[AttentionSpec],
        backends: list[AttentionBackend],
        ops: Ops,
        dtype: torch.dtype,
        layer_cls: type[DecoderLayer] = DecoderLayer,
        first_layer: int = 0,
    ) -> None:
        """`first_layer`: the model index of `specs[0]`'s layer (a pipeline stage's first)."""
        super().__init__()
        head_size = specs[0].head_size
        params = rope_parameters(hf_config)
        rotary_dim = int(head_size * params.get("partial_rotary_factor", 1.0))
        self.rotary_emb = RotaryEmbedding(
            params, rotary_dim, hf_config.max_position_embeddings, ops
        )
        self.embed_tokens = Embedding(hf_config.vocab_size, hf_config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            layer_cls(hf_config, spec, self.rotary_emb, backend, ops, dtype,
                      layer_index=first_layer + i)
            for i, (spec, backend) in enumerate(zip(specs, backends, strict=True))
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, ops, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: list[AttentionMetadata],
    ) -> torch.Tensor:
        """`metadata[i]` is layer i's (its KV group's)."""
        sp = self.__dict__.get("sequence_parallel")  # tensor parallel's SequenceParallel
        if sp is not None:
            sp.num_tokens = input_ids.shape[0]
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metadata, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden if sp is None else sp.gather(hidden)


class CausalLM(nn.Module):
    """A llama / qwen2 / qwen3 causal LM over a paged KV cache; the base of other families.

    Build it in its final dtype under the target device (`with torch.device(d): CausalLM(...)`),
    then `load_weights`. Parameters never require grad. The caller (the model runner) calls
    `attention_backend.prepare(metadata)` once per step before `forward`; the model does not.

    A family subclasses it and overrides `attention_specs_for` (its layers' specs),
    `_build_model` (the `model.` body) and, if its checkpoint names or lays out weights
    otherwise, `_convert` (HF tensor -> our parameters).
    """

    # whether `tie_word_embeddings` in the config ties the LM head to the embedding, as
    # transformers' class for the family does (False: it always keeps its own head)
    ties_embeddings: bool = True

    @classmethod
    def head_is_tied(cls, hf_config: Any) -> bool:
        """Whether this family, under `hf_config`, uses the embedding as its LM head."""
        return cls.ties_embeddings and bool(getattr(hf_config, "tie_word_embeddings", False))

    def __init__(
        self,
        hf_config: Any,
        *,
        ops: Ops,
        attention_backend: BackendChoice,
        dtype: torch.dtype,
        block_size: int,
    ) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.dtype = dtype
        # tensor parallel: the layers are built at one rank's shapes (tokenmill.model.parallel)
        state = get_parallel_state()
        self.tp = state.tp
        self.pcp = state.group("pcp")  # prefill context parallel (model/prefill_context_parallel)
        # pipeline parallel: this stage builds its own layers only (tokenmill.model.pipeline)
        self.pp = state.group("pp")
        full_config = hf_config
        if self.tp.world_size > 1:
            hf_config = parallel.local_config(hf_config, self.tp.world_size, state.expert_parallel)
        self.attention_specs: list[AttentionSpec] = self.attention_specs_for(
            hf_config, dtype, block_size
        )
        model_specs = self.attention_specs  # every layer's, at this rank's TP shapes
        layers = range(len(self.attention_specs))
        if self.pp.world_size > 1:
            layers = pipeline.stage_layers(
                len(self.attention_specs), self.pp.world_size, self.pp.rank_in_group
            )
            self.attention_specs = self.attention_specs[layers.start : layers.stop]
        backends = self._choose_backends(state, attention_backend, block_size)
        # each layer's backend, whose declared cache layout the arena views its pages as
        self.layer_backends: list[AttentionBackend] = backends
        # the distinct backends, for the runner's once-per-step `prepare`
        self.attention_backends = list({id(b): b for b in backends}.values())
        # the model index of this stage's first layer: a family that builds a layer by
        # its index (dense or MoE) reads it in `_build_model`
        self.first_layer = layers.start
        # which layers share a block table (and metadata) and which arena slot each uses;
        # a pipeline stage keeps the model's groups, which the engine's tables are for
        self.kv_layout: KVLayout = plan_groups(self.attention_specs)
        if self.pp.world_size > 1:
            self.kv_layout = pipeline.stage_kv_layout(plan_groups(model_specs), layers)
        self.model = self._build_model(hf_config, self.attention_specs, backends, ops, dtype)
        self.ops = ops
        self._logits_fn = None
        self.tie_word_embeddings = self.head_is_tied(hf_config)
        self.lm_head = None
        if not self.tie_word_embeddings:
            self.lm_head = Linear(hf_config.hidden_size, hf_config.vocab_size, False, dtype)
        if self.tp.world_size > 1:
            parallel.apply_tensor_parallel(self, full_config, self.tp, state.sequence_parallel)
        self._stage_keeps = None
        if self.pp.world_size > 1:
            pipeline.apply_pipeline_parallel(self, hf_config, layers, self.pp)
            self._stage_keeps = pipeline.stage_weight_filter(
                full_config, self.pp.world_size, self.pp.rank_in_group,
                tied=self.tie_word_embeddings,
            )
        self.requires_grad_(False)

    def _choose_backends(
        self, state: Any, attention_backend: BackendChoice, block_size: int
    ) -> list[AttentionBackend]:
        """Each layer's attention backend: the platform's (a chooser per spec, or one for
        every layer), wrapped for prefill context parallel; the core's partial attention
        under decode context parallel (which also shrinks the specs' physical blocks)."""
        dcp = state.group("dcp")
        if dcp.world_size > 1:  # the KV cache spread over the dcp ranks, token by token
            check_decode_context_parallel(self.attention_specs, block_size, dcp.world_size)
            self.attention_specs = [
                dataclasses.replace(s, block_size=block_size // dcp.world_size)
                for s in self.attention_specs
            ]
            logger.info("decode context parallel over %d ranks: attention runs on the core's "
                        "partial attention, not the platform's backend", dcp.world_size)
            return [DecodeContextParallelAttention(dcp)] * len(self.attention_specs)
        backends = resolve_backends(self.attention_specs, attention_backend)
        if self.pcp.world_size > 1:  # prefill split over the pcp ranks, KV all-gathered
            wrapped = {id(b): PrefillContextParallelAttention(b, self.pcp) for b in backends}
            backends = [wrapped[id(b)] for b in backends]
        return backends

    @classmethod
    def attention_specs_for(
        cls, hf_config: Any, dtype: torch.dtype, block_size: int
    ) -> list[AttentionSpec]:
        """The attention spec of every layer, from the config alone (the engine plans its
        KV groups with it before any worker has built the model)."""
        return attention_specs(hf_config, dtype, block_size)

    def _build_model(
        self,
        hf_config: Any,
        specs: list[AttentionSpec],
        backends: list[AttentionBackend],
        ops: Ops,
        dtype: torch.dtype,
    ) -> nn.Module:
        return Model(hf_config, specs, backends, ops, dtype, first_layer=self.first_layer)

    def _convert(
        self, hf_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        """One checkpoint tensor -> (our parameter name, shard index or None, tensor)."""
        name, shard = self._map_name(hf_name)
        yield name, shard, tensor

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Run one engine step; returns the final-normed hidden states [num_tokens, hidden]
        (None on a pipeline stage before the last, which sends its activations on).

        `input_ids` and `positions` are int64 [num_tokens], flattened sequence by sequence as in
        `metadata`; `kv_caches[i]` is layer i's [2, num_blocks, block_size, num_kv_heads,
        head_size] cache, which the step's keys and values are written into. `metadata` is
        one for every layer, or a list with one per KV group (`kv_layout.groups`), which
        differ in their block tables.
        """
        if len(kv_caches) != len(self.attention_specs):
            raise ValueError(
                f"got {len(kv_caches)} kv caches for {len(self.attention_specs)} layers"
            )
        per_layer = self.layer_metadata(metadata)
        if self.pp.world_size > 1:  # None on every stage but the last
            return pipeline.stage_forward(self.model, input_ids, positions, kv_caches, per_layer)
        if prefill_context_parallel.should_split(input_ids.shape[0], self.pcp):
            return prefill_context_parallel.split_forward(
                self.model, self.pcp, input_ids, positions, kv_caches, per_layer,
                self.attention_backends,
            )
        return self.model(input_ids, positions, kv_caches, per_layer)

    def layer_metadata(
        self, metadata: AttentionMetadata | list[AttentionMetadata]
    ) -> list[AttentionMetadata]:
        """Each layer's metadata: its KV group's when given per group."""
        if not isinstance(metadata, list):
            return [metadata] * len(self.attention_specs)
        groups = self.kv_layout.groups
        if len(metadata) != len(groups):
            raise ValueError(f"got metadata for {len(metadata)} KV groups; the model has {len(groups)}")
        return [metadata[g] for g in self.kv_layout.layer_group]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [n, vocab] logits for hidden states [n, hidden] (matmul in the model dtype)."""
        if self._logits_fn is not None:
            logits = self._logits_fn(hidden)
        else:
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight)
        if self.tp.world_size > 1:  # each rank has a block of the vocab
            logits = parallel.gather_logits(logits, self.hf_config.vocab_size, self.tp)
        return logits.float()

    def prepack(self) -> None:
        """Hand every loaded matmul weight to the platform's `prepack_linear` (once, after
        `load_weights`), so that a platform can keep weights in its fastest layout."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(self.ops)
        if self.lm_head is not None:
            self._logits_fn = self.lm_head
        elif self.model.embed_tokens is not None:  # tied: the embedding doubles as the head
            self._logits_fn = self.ops.prepack_linear(self.model.embed_tokens.weight, None)
        # else: a pipeline stage before the last, which computes no logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the parameters (cast to their dtype/device).

        q/k/v and gate/up are merged into the fused projections; rotary `inv_freq` buffers and,
        with tied embeddings, `lm_head.weight` are skipped. Raises KeyError naming an unknown
        weight, ValueError naming a shape mismatch and, at the end, KeyError naming the
        parameters (or fused shards) the checkpoint did not provide.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        expected: set[tuple[str, int | None]] = set()
        for name, _ in params.items():
            module_name, _, _ = name.rpartition(".")
            module = modules[module_name]
            if isinstance(module, MergedLinear):
                expected.update((name, s) for s in range(len(module.output_sizes)))
            elif hasattr(module, "checkpoint_shards"):  # a module that loads its own share
                expected.update((name, s) for s in module.checkpoint_shards(name.rpartition(".")[2]))
            else:
                expected.add((name, None))
        loaded: set[tuple[str, int | None]] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # the embedding is the head
            if self._stage_keeps is not None and not self._stage_keeps(hf_name):
                continue  # another pipeline stage's
            for name, shard, converted in self._convert(hf_name, tensor):
                if name not in params:
                    raise KeyError(
                        f"checkpoint weight {hf_name!r} has no parameter in "
                        f"{type(self).__name__} ({self.hf_config.model_type}); is the config "
                        "right?"
                    )
                if self.tp.world_size > 1:  # only this rank's slice reaches the device
                    module_name, _, param_name = name.rpartition(".")
                    converted = parallel.narrow_for_rank(
                        modules[module_name], param_name, shard, converted
                    )
                module_name, _, param_name = name.rpartition(".")
                loader = getattr(modules[module_name], "load_checkpoint_tensor", None)
                if loader is not None:  # e.g. FusedMoE: narrows to this rank's experts itself
                    loaded.update((name, s) for s in loader(param_name, shard, converted))
                    continue
                if shard is None:
                    param = params[name]
                    if tuple(converted.shape) != tuple(param.shape):
                        raise ValueError(
                            f"checkpoint weight {hf_name!r} has shape {tuple(converted.shape)}, "
                            f"expected {tuple(param.shape)}"
                        )
                    param.copy_(converted)
                else:
                    modules[module_name].load_shard(param_name, shard, converted)
                loaded.add((name, shard))
        missing = sorted(self._hf_name(n, s) for n, s in expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (
                f", ... ({len(missing)} in all)" if len(missing) > 8 else ""
            )
            raise KeyError(f"checkpoint is missing weights: {shown}")

    @staticmethod
    def _map_name(hf_name: str) -> tuple[str, int | None]:
        """HF parameter name -> (our parameter name, shard index or None)."""
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED_SHARDS:
            fused, shard = _FUSED_SHARDS[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard
        return hf_name, None

    @staticmethod
    def _hf_name(name: str, shard: int | None) -> str:
        """Our parameter (and shard) -> the HF name it is loaded from, for error messages."""
        if shard is None:
            return name
        parts = name.split(".")
        hf = next((k for k, v in _FUSED_SHARDS.items() if v == (parts[-2], shard)), None)
        if hf is None:  # a module's own shard numbering (FusedMoE: per expert)
            return f"{name} (shard {shard})"
        return ".".join([*parts[:-2], hf, parts[-1]])
