"""The base classes every family builds on: `CausalLM` (the model the runner drives) and
`DecoderModel` (HF's `model.` body), for one rank of any parallel layout.

A family (one module of `tokenmill.model.families`, with its `ModelFamily` descriptor)
subclasses them: its `DecoderModel` says how to build layer i (`make_layer`), what its
layers share (`setup`: rotary tables), its norm and its embedding's scaling; its
`CausalLM` names that body (`body_cls`) and, if its checkpoint names or lays out weights
otherwise, converts them (`_convert`: HF tensor -> our parameters).

Everything parallel is decided at construction, from the `ParallelState` passed in:
tensor parallel builds every layer at one rank's shapes through the `LayerBuilder`
(core/model/linear.py) from the family's rank-local config; pipeline parallel builds
only the stage's layers (`pipeline.Stage`); context parallel picks the attention
backends. Nothing is swapped or stamped afterwards.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import ParallelState
from tokenmill.kv.groups import KVLayout, plan_groups
from tokenmill.model import parallel, pipeline, prefill_context_parallel
from tokenmill.model.context_parallel import (
    DecodeContextParallelAttention,
    check_decode_context_parallel,
)
from tokenmill.model.family import ModelFamily
from tokenmill.model.kv_scales import is_kv_scale, load_kv_scale, with_kv_cache_dtype
from tokenmill.model.layers import BackendChoice, RMSNorm, resolve_backends
from tokenmill.model.linear import LayerBuilder, Linear, MergedLinear, SchemeChooser
from tokenmill.model.moe import FusedMoE
from tokenmill.model.prefill_context_parallel import PrefillContextParallelAttention
from tokenmill.model.quant import QuantizedCheckpointTensor, QuantizedExperts, QuantizedWeights
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.ops import Ops
from tokenmill.platforms.ops.quant import QuantizedWeight

logger = logging.getLogger(__name__)

# HF projection name -> (fused module name, shard index within it)
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def attention_specs(hf_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    """One spec per layer of a multi-head attention model; a layer is SLIDING_WINDOW when
    `layer_types` marks it so."""
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


class DecoderModel(nn.Module):
    """HF's `model.` body: embedding, decoder layers, final norm, for one pipeline stage
    (`stage`: only its layers are built, the embedding and norm only where it runs them)
    and one TP rank (`build`). Layers are called as layer(positions, hidden, residual,
    kv_cache, metadata) -> (hidden, residual), the next norm adding the two."""

    norm_cls: type[nn.Module] = RMSNorm
    # layers whose input residual stream `forward` keeps in `aux_hidden` (EAGLE-3's)
    aux_layers: tuple[int, ...] = ()

    def __init__(
        self, hf_config: Any, specs: list[AttentionSpec], backends: list[AttentionBackend],
        build: LayerBuilder, stage: pipeline.Stage,
    ) -> None:
        super().__init__()
        self.hidden_size, self.dtype = hf_config.hidden_size, build.dtype
        self.stage, self.sp = stage, build.sp
        self.setup(hf_config, specs, build)
        self.embed_tokens = None
        if stage.has_embedding:
            self.embed_tokens = build.embedding("model.embed_tokens", hf_config.vocab_size,
                                                hf_config.hidden_size)
        self.layers = pipeline.place_layers(stage, (
            self.make_layer(hf_config, i, spec, backend, build, f"model.layers.{i}")
            for i, spec, backend in zip(stage.layers, specs, backends, strict=True)
        ))
        self.norm = None
        if stage.is_last:
            self.norm = self.norm_cls(hf_config.hidden_size, hf_config.rms_norm_eps, build.ops,
                                      build.dtype)

    def setup(self, hf_config: Any, specs: list[AttentionSpec], build: LayerBuilder) -> None:
        """Build what the layers share (a rotary table), before them."""

    def make_layer(
        self, hf_config: Any, index: int, spec: AttentionSpec, backend: AttentionBackend,
        build: LayerBuilder, prefix: str,
    ) -> nn.Module:
        """Decoder layer `index` (the model's index) with attention `spec` on `backend`."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embedding (a family that scales it overrides this)."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: list[AttentionMetadata],
    ) -> torch.Tensor:
        """`metadata[i]` is layer i's (its KV group's). Without pipeline parallel (a stage
        runs `pipeline.stage_forward`)."""
        sp = self.sp
        if sp is not None:
            sp.num_tokens = input_ids.shape[0]
        hidden = self.embed(input_ids)
        residual = None
        if self.aux_layers:
            return self._forward_capturing(positions, hidden, kv_caches, metadata)
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metadata, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden if sp is None else sp.gather(hidden)

    def _forward_capturing(self, positions, hidden, kv_caches, metadata) -> torch.Tensor:
        """`forward` keeping the residual stream entering each layer of `aux_layers` (the
        number of layers: the last one's output) in `aux_hidden`, in that order (an
        EAGLE-3 draft head reads them, core/spec_decode/draft_models.py)."""
        residual, captured = None, {}
        for i, (layer, kv_cache, meta) in enumerate(
                zip(self.layers, kv_caches, metadata, strict=True)):
            if i in self.aux_layers:
                captured[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        captured[len(self.layers)] = hidden + residual
        self.aux_hidden = [captured[i] for i in self.aux_layers]
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """A causal LM over a paged KV cache (and recurrent state slots), one rank's share.

    Build it in its final dtype under the target device (`with torch.device(d): ...`),
    then `load_weights`. Parameters never require grad. The caller (the model runner)
    calls `attention_backend.prepare(metadata)` once per step before `forward`; the model
    does not. `family`: its descriptor (looked up by model_type when not given);
    `parallel`: this rank's groups (one rank when not given); `schemes`: each linear
    layer's weight scheme by its module name (dense in `dtype` when not given).
    """

    body_cls: type[DecoderModel] = DecoderModel

    def __init__(
        self,
        hf_config: Any,
        *,
        ops: Ops,
        attention_backend: BackendChoice,
        dtype: torch.dtype,
        block_size: int,
        family: ModelFamily | None = None,
        parallel: ParallelState | None = None,
        schemes: SchemeChooser | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if family is None:
            from tokenmill.model.registry import family_for  # the registry imports families

            family = family_for(hf_config)
        state = parallel if parallel is not None else ParallelState.single()
        self.hf_config, self.dtype, self.family, self.ops = hf_config, dtype, family, ops
        self.tp = state.tp
        self.pcp = state.group("pcp")  # prefill context parallel (model/prefill_context_parallel)
        self.pp = state.group("pp")  # pipeline parallel: this stage builds its own layers only
        full_config = hf_config
        if self.tp.world_size > 1:  # the layers are built at one rank's shapes
            hf_config = family.local_config(hf_config, self.tp.world_size, state.expert_parallel)
        sequence_parallel = state.sequence_parallel and self.tp.world_size > 1
        if sequence_parallel and not family.sequence_parallel:
            raise ValueError(f"enable_sequence_parallelism does not support the {family.name!r} "
                             f"family ({full_config.model_type!r})")
        # every layer's, each attention layer's cache in `kv_cache_dtype` when set
        model_specs = with_kv_cache_dtype(
            family.attention_specs(hf_config, dtype, block_size), kv_cache_dtype
        )
        # the KV cache scales the checkpoint set (their names): calibration leaves them be
        self.checkpoint_kv_scales: list[str] = []
        self.tie_word_embeddings = family.head_is_tied(full_config)
        stage = pipeline.Stage.of(self.pp, len(model_specs), self.tie_word_embeddings)
        self.attention_specs: list[AttentionSpec] = model_specs[stage.layers.start : stage.layers.stop]
        backends = self._choose_backends(state, attention_backend, block_size)
        # each layer's backend, whose declared cache layout the arena views its pages as
        self.layer_backends: list[AttentionBackend] = backends
        # the distinct backends, for the runner's once-per-step `prepare`
        self.attention_backends = list({id(b): b for b in backends}.values())
        # the model index of this stage's first layer
        self.first_layer = stage.layers.start
        # which layers share a block table (and metadata) and which arena slot each uses;
        # a pipeline stage keeps the model's groups, which the engine's tables are for
        self.kv_layout: KVLayout = plan_groups(self.attention_specs)
        if self.pp.world_size > 1:
            self.kv_layout = pipeline.stage_kv_layout(plan_groups(model_specs), stage.layers)
        build = self._layer_builder(full_config, state, ops, dtype, schemes, sequence_parallel)
        self.model = self._build_model(hf_config, self.attention_specs, backends, build, stage)
        self._logits_fn = None
        # a tied embedding the checkpoint holds quantized (GGUF's Q8_0 `token_embd`): the
        # lookup reads a dense copy, the head runs on these codes (`prepack`)
        self.quantized_head: QuantizedCheckpointTensor | None = None
        self.lm_head = None
        if not self.tie_word_embeddings and stage.is_last:
            self.lm_head = build.lm_head("lm_head", hf_config.hidden_size, hf_config.vocab_size)
        self._stage_keeps = None
        if self.pp.world_size > 1:
            self._stage_keeps = pipeline.stage_weight_filter(
                full_config, self.pp.world_size, self.pp.rank_in_group,
                tied=self.tie_word_embeddings, final_norm=family.final_norm,
            )
        self.requires_grad_(False)

    def _layer_builder(
        self, full_config: Any, state: ParallelState, ops: Ops, dtype: torch.dtype,
        schemes: SchemeChooser | None, sequence_parallel: bool,
    ) -> LayerBuilder:
        """The construction point of this rank's layers; the attention heads and vocab
        rows it splits come from the whole model's config."""
        heads = None
        if self.tp.world_size > 1:
            num_heads = full_config.num_attention_heads
            num_kv = getattr(full_config, "num_key_value_heads", None) or num_heads
            heads = parallel.head_shards(num_heads, num_kv, self.tp.world_size,
                                         self.tp.rank_in_group)
        return LayerBuilder(ops=ops, dtype=dtype, parallel=state, schemes=schemes, heads=heads,
                            vocab_size=full_config.vocab_size,
                            sequence_parallel=sequence_parallel)

    def _choose_backends(
        self, state: ParallelState, attention_backend: BackendChoice, block_size: int
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

    def _build_model(
        self, hf_config: Any, specs: list[AttentionSpec], backends: list[AttentionBackend],
        build: LayerBuilder, stage: pipeline.Stage,
    ) -> DecoderModel:
        return self.body_cls(hf_config, specs, backends, build, stage)

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
        metadata: AttentionMetadata | list[AttentionMetadata],
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
        """Hand every loaded matmul weight to its scheme's `prepack` (the platform's
        `prepack_linear`: once, after `load_weights`), so that a platform can keep weights
        in its fastest layout."""
        # a quantized layer on a platform without a kernel for its scheme logs there
        # (tokenmill.platforms.ops.quant.ReferenceQuantizedLinear)
        for module in self.modules():
            if isinstance(module, (Linear, FusedMoE)):
                module.prepack(self.ops)
        if self.lm_head is not None:
            self._logits_fn = self.lm_head
        elif self.quantized_head is not None:  # tied, and quantized in the checkpoint
            self._logits_fn = self.ops.prepack_quantized_linear(self._head_weight(), None)
            logger.info("the tied LM head runs on the checkpoint's %s codes (the embedding "
                        "lookup on a dense copy)", self.quantized_head.scheme.format)
        elif self.model.embed_tokens is not None:  # tied: the embedding doubles as the head
            self._logits_fn = self.ops.prepack_linear(self.model.embed_tokens.weight, None)
        # else: a pipeline stage before the last, which computes no logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the parameters (cast to their dtype/device).

        q/k/v and gate/up are merged into the fused projections; rotary `inv_freq` buffers and,
        with tied embeddings, `lm_head.weight` are skipped; under tensor parallel each tensor
        is narrowed to this rank's share first. Raises KeyError naming an unknown weight,
        ValueError naming a shape mismatch and, at the end, KeyError naming the parameters
        (or fused shards) the checkpoint did not provide.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        expected = self._expected_shards(params, modules)
        loaded: set[tuple[str, int | None]] = set()
        dequantized: list[str] = []  # quantized checkpoint weights of layers built dense
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # the embedding is the head
            if self._stage_keeps is not None and not self._stage_keeps(hf_name):
                continue  # another pipeline stage's
            if isinstance(tensor, QuantizedCheckpointTensor):
                kept = self._load_quantized(hf_name, tensor, modules)
                if kept:
                    loaded.update(kept)
                    continue
                if self._is_tied_embedding(hf_name):
                    # the head keeps the codes (`prepack`, which logs it); the lookup a
                    # dense copy
                    self.quantized_head = tensor
                else:
                    dequantized.append(hf_name)
                tensor = tensor.dense()  # a layer built dense
            if is_kv_scale(hf_name):  # a quantized KV cache's scale, not a parameter
                if load_kv_scale(modules, hf_name, tensor):
                    self.checkpoint_kv_scales.append(hf_name)
                continue
            for name, shard, converted in self._convert(hf_name, tensor):
                if name not in params:
                    raise KeyError(
                        f"checkpoint weight {hf_name!r} has no parameter in "
                        f"{type(self).__name__} ({self.hf_config.model_type}); is the config "
                        "right?"
                    )
                module_name, _, param_name = name.rpartition(".")
                module = modules[module_name]
                if self.tp.world_size > 1:  # only this rank's slice reaches the device
                    converted = parallel.narrow_for_rank(module, param_name, shard, converted)
                loader = getattr(module, "load_checkpoint_tensor", None)
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
                    module.load_shard(param_name, shard, converted)
                loaded.add((name, shard))
        self._log_dequantized(dequantized, modules)
        missing = sorted(self._hf_name(n, s) for n, s in expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (
                f", ... ({len(missing)} in all)" if len(missing) > 8 else ""
            )
            raise KeyError(f"checkpoint is missing weights: {shown}")

    def _is_tied_embedding(self, hf_name: str) -> bool:
        """Whether checkpoint weight `hf_name` is the embedding that doubles as this
        stage's head (one tensor-parallel rank only: a vocab-split quantized head is not
        built, it runs dense)."""
        return (self.tie_word_embeddings and self.tp.world_size == 1
                and self.model.embed_tokens is not None
                and self.checkpoint_param(hf_name)[0] == "model.embed_tokens.weight")

    def _head_weight(self) -> QuantizedWeight:
        """The quantized tied head [vocab, hidden] as the ops take it, on the embedding's
        device."""
        q = self.quantized_head
        device = self.model.embed_tokens.weight.device
        parts = {name: t.to(device) for name, t in q.parts().items()}
        out, n = q.shape
        return QuantizedWeight(q.scheme, parts["weight_codes"], parts["weight_scales"],
                               parts.get("weight_offsets"), n, out)

    @staticmethod
    def _log_dequantized(names: list[str], modules: dict[str, nn.Module]) -> None:
        """Say which quantized checkpoint weights went into dense layers: a warning when
        other layers run quantized (a fallback: MoE experts, mixed fused parts), info
        when the whole model is dense (`--quantization none` asked for it)."""
        if not names:
            return
        kept = any(isinstance(getattr(m, "scheme", None), QuantizedWeights)
                   for m in modules.values())
        logger.log(logging.WARNING if kept else logging.INFO,
                   "%d quantized checkpoint weights dequantized at load into layers built "
                   "dense (%s%s)", len(names), ", ".join(names[:3]),
                   ", ..." if len(names) > 3 else "")

    def _load_quantized(
        self, hf_name: str, tensor: QuantizedCheckpointTensor, modules: dict[str, nn.Module]
    ) -> set[tuple[str, int | None]]:
        """Copy a quantized checkpoint weight's parts into its layer when the layer was
        built in the same scheme; returns the (parameter, shard) pairs filled (none: the
        caller dequantizes it)."""
        name, shard = self.checkpoint_param(hf_name)
        module_name, _, param_name = name.rpartition(".")
        module = modules.get(module_name)
        scheme = getattr(module, "scheme", None)
        if isinstance(scheme, QuantizedExperts):  # a FusedMoE's routed experts
            if scheme.projection(param_name) != tensor.scheme:
                return set()
            filled = set()
            for part, value in tensor.parts().items():
                target = f"{param_name}_{part.removeprefix('weight_')}"
                filled.update((f"{module_name}.{target}", s)
                              for s in module.load_checkpoint_tensor(target, shard, value))
            return filled
        if not isinstance(scheme, QuantizedWeights) or scheme.quant != tensor.scheme:
            return set()
        if self.tp.world_size > 1:
            raise ValueError(f"{hf_name}: quantized weights are not split over tensor "
                             "parallel ranks yet; use --quantization none with TP")
        filled = set()
        for part, value in tensor.parts().items():
            if shard is None:
                param = getattr(module, part)
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(f"checkpoint weight {hf_name!r} ({part}) has shape "
                                     f"{tuple(value.shape)}, expected {tuple(param.shape)}")
                param.copy_(value)
            else:
                module.load_shard(part, shard, value)
            filled.add((f"{module_name}.{part}", shard))
        return filled

    @staticmethod
    def _expected_shards(
        params: dict[str, nn.Parameter], modules: dict[str, nn.Module]
    ) -> set[tuple[str, int | None]]:
        """(parameter, shard) pairs the checkpoint must fill: one per fused part of a
        merged projection, what a module that loads its own share asks for, else one."""
        expected: set[tuple[str, int | None]] = set()
        for name in params:
            module_name, _, param_name = name.rpartition(".")
            module = modules[module_name]
            if isinstance(module, MergedLinear):
                expected.update((name, s) for s in range(len(module.output_sizes)))
            elif hasattr(module, "checkpoint_shards"):  # a module that loads its own share
                expected.update((name, s) for s in module.checkpoint_shards(param_name))
            else:
                expected.add((name, None))
        return expected

    @classmethod
    def expert_name(cls, hf_name: str) -> tuple[str, int | None] | None:
        """A routed expert's checkpoint weight -> (our FusedMoE parameter, shard), as
        `_convert` maps it (the MoE families say; None here: no experts). Read without
        the tensor, to plan which experts stay quantized."""
        return None

    @classmethod
    def checkpoint_param(cls, hf_name: str) -> tuple[str, int | None]:
        """(our parameter, shard) of checkpoint weight `hf_name` without its tensor: a
        routed expert's (`expert_name`) or `_map_name`'s."""
        return cls.expert_name(hf_name) or cls._map_name(hf_name)

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
