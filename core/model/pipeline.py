"""Pipeline parallelism: which layers a stage owns, the KV groups it keeps, and the
activations it hands on. Every family built on `CausalLM` and `DecoderModel`
(core/model/base.py) splits this way, hybrids included.

A model split over p stages (the "pp" dimension of tokenmill.distributed.parallel_state)
is built per stage in `CausalLM.__init__`:

1. `stage_layers` gives the stage its contiguous run of decoder layers (as even as the
   layer count allows; earlier stages take the remainder). Only those layers are
   built, so a stage's KV arena holds its own layers' caches and nothing else.
2. `DecoderModel` builds them at their global indices in a full-length `ModuleList`
   (`place_layers`: the others are parameterless `PPMissingLayer`s), so parameter names
   stay the checkpoint's (`model.layers.7...`), and builds only what the stage runs
   (`Stage`): the embedding on the first stage (and on the last when the head is tied
   to it), the final norm and LM head on the last.
3. `stage_kv_layout` keeps the whole model's KV groups (the engine plans its block
   tables for those, so a step's metadata comes one per model group) and gives the
   stage's layers their groups and slots, the slots renumbered densely: a stage's arena
   holds its own layers' slots only. A hybrid stage may hold recurrent layers only; its
   pages are then sized by its states, and a state still fits the block ids the engine
   gives it (as many as the model-wide page size needs, each page at least as large).
4. The loader skips every checkpoint tensor `stage_weight_filter` gives to another stage
   without reading it (safetensors), and `load_weights` skips any that still arrive: no
   stage's device holds another's weights.

Forward (`stage_forward`): the first stage embeds; every other stage receives the
previous stage's hidden states and residual stream ([2, num_tokens, hidden], one
message) through the pp group's communicator; each runs its layers; every stage but
the last sends the pair on and returns None, the last applies the final norm and returns
the hidden states the runner samples from. With tensor parallel inside each stage, the
pp group of a rank holds the ranks of the same TP index in every stage, so each TP rank
hands its (replicated) activations to its counterpart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.distributed.parallel_state import GroupCoordinator
from tokenmill.kv.groups import KVLayout
from tokenmill.platforms.interfaces import AttentionMetadata


def stage_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """The decoder layers of `stage`: a contiguous run, sizes differing by at most one."""
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers; "
            "every stage needs at least one"
        )
    base, extra = divmod(num_layers, pp_size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class PPMissingLayer(nn.Module):
    """The place of a layer another stage runs: no parameters, never called."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("PPMissingLayer is another pipeline stage's layer; it never runs here")


@dataclasses.dataclass(frozen=True)
class Stage:
    """What one pipeline stage builds: `layers` of the model's `num_layers`, and which
    of the embedding, final norm and LM head (`pp`: its group; one stage without pp)."""

    pp: GroupCoordinator
    num_layers: int
    layers: range
    tied: bool  # the LM head is the embedding

    @classmethod
    def of(cls, pp: GroupCoordinator, num_layers: int, tied: bool) -> Stage:
        if pp.world_size == 1:
            return cls(pp, num_layers, range(num_layers), tied)
        return cls(pp, num_layers, stage_layers(num_layers, pp.world_size, pp.rank_in_group), tied)

    @property
    def is_first(self) -> bool:
        return self.pp.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.pp.rank_in_group == self.pp.world_size - 1

    @property
    def has_embedding(self) -> bool:
        """The first stage embeds; the last computes logits with it when it is the head."""
        return self.is_first or (self.is_last and self.tied)


def place_layers(stage: Stage, built: Iterable[nn.Module]) -> nn.ModuleList:
    """The stage's layers (`built`, in order) at their model indices, `PPMissingLayer`s
    in the other places."""
    full: list[nn.Module] = [PPMissingLayer() for _ in range(stage.num_layers)]
    local = list(built)
    if len(local) != len(stage.layers):
        raise ValueError(f"stage built {len(local)} layers for the {len(stage.layers)} of "
                         f"{stage.layers}")
    for i, layer in zip(stage.layers, local, strict=True):
        full[i] = layer
    return nn.ModuleList(full)


def stage_kv_layout(model_layout: KVLayout, layers: range) -> KVLayout:
    """The KV layout of the stage running `layers`: the model's groups (as the engine
    numbers them), each stage layer's group, and its slot among the distinct slots the
    stage uses, renumbered 0.. in order (layers of one group keep distinct slots; layers
    that shared a slot across groups still share it)."""
    used = sorted({model_layout.layer_slot[i] for i in layers})
    dense = {slot: j for j, slot in enumerate(used)}
    return KVLayout(
        groups=model_layout.groups,
        num_slots=len(used),
        layer_group=tuple(model_layout.layer_group[i] for i in layers),
        layer_slot=tuple(dense[model_layout.layer_slot[i]] for i in layers),
        page_bytes=model_layout.page_bytes,
    )


def stage_weight_filter(
    hf_config: Any, pp_size: int, stage: int, *, tied: bool, final_norm: str = "model.norm."
) -> Callable[[str], bool]:
    """Whether a checkpoint tensor (by HF name) belongs to `stage`: its layers', the
    embedding on the first stage (and on the last when the head is `tied` to it: the
    family's rule, `ModelFamily.head_is_tied`), the final norm (`final_norm`: its
    checkpoint prefix, the family's) and the LM head on the last. Decided before any
    tensor is read, so the loader can skip other stages' tensors."""
    layers = stage_layers(hf_config.num_hidden_layers, pp_size, stage)
    is_first, is_last = stage == 0, stage == pp_size - 1

    def keep(hf_name: str) -> bool:
        parts = hf_name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
            return int(parts[2]) in layers
        if hf_name.startswith("model.embed_tokens."):
            return is_first or (is_last and tied)
        if hf_name.startswith((final_norm, "lm_head.")):
            return is_last
        return True

    return keep


def stage_forward(
    body: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    metadata: list[AttentionMetadata],
) -> torch.Tensor | None:
    """One stage's share of the step. `kv_caches` and `metadata` are this stage's layers',
    in order. Returns the final-normed hidden states on the last stage, None elsewhere."""
    pp: GroupCoordinator = body.stage.pp
    layers = [body.layers[i] for i in body.stage.layers]
    if pp.is_first:
        hidden, residual = body.embed(input_ids), None
    else:
        pair = torch.empty(2, input_ids.shape[0], body.hidden_size, dtype=body.dtype,
                           device=input_ids.device)
        pp.communicator.recv(pair, pp.rank_in_group - 1)
        hidden, residual = pair[0], pair[1]
    for layer, kv_cache, meta in zip(layers, kv_caches, metadata, strict=True):
        hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
    if pp.rank_in_group < pp.world_size - 1:
        if residual is None:  # a stage of no layers cannot exist (stage_layers refuses)
            raise RuntimeError("a pipeline stage ran no layer")
        pp.communicator.send(torch.stack([hidden, residual]), pp.rank_in_group + 1)
        return None
    hidden, _ = body.norm(hidden, residual)
    return hidden


def check_pipeline(hf_config: Any, pp_size: int, supported: bool = True) -> None:
    """ValueError naming the problem when `hf_config` cannot be split into `pp_size`
    stages (checked by the engine before any worker starts); `supported`: whether its
    family's layers split into stages."""
    if not supported:
        raise ValueError(
            f"pipeline parallel does not support model type {hf_config.model_type!r}; use "
            "pipeline_parallel_size=1"
        )
    stage_layers(hf_config.num_hidden_layers, pp_size, 0)
