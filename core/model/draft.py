"""What every draft model of model-based speculative decoding shares (the family-specific
ones live in their family's file and are named by its descriptor: `ModelFamily.mtp`,
`ModelFamily.eagle3`; core/spec_decode/draft_models.py builds them, docs/speculative.md).

A draft model is one decoder layer with its own KV in the arena (its attention specs join
the target's KV groups: the same block tables, slots of their own), fed the target's
hidden states. Each subclasses its family's `CausalLM` only to reuse its checkpoint
loading (`load_weights`, `_convert`): parameters are named as the checkpoint names them.
A chained draft step feeds a model its own hidden state and the token it drafted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.model.base import attention_specs
from tokenmill.model.linear import LayerBuilder, Linear
from tokenmill.model.parallel import gather_logits
from tokenmill.platforms.interfaces import AttentionSpec


def head_logits(head: Linear, hidden: torch.Tensor, vocab_size: int, tp: Any) -> torch.Tensor:
    logits = head(hidden)
    if tp.world_size > 1:
        logits = gather_logits(logits, vocab_size, tp)
    return logits.float()


class DraftBase:
    """What the proposer (core/worker/drafting.py) uses of a draft model."""

    attention_specs: list[AttentionSpec]
    layer_backends: list[nn.Module]
    aux_layers: tuple[int, ...] = ()  # target layers whose input streams it reads

    def _init_loading(self, hf_config: Any, build: LayerBuilder) -> None:
        self.hf_config, self.tp = hf_config, build.tp
        self.tie_word_embeddings, self._stage_keeps, self.ops = False, None, build.ops

    def prepack(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(self.ops)


def mtp_layers(hf_config: Any) -> int:
    """How many MTP modules the checkpoint declares (0: none)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def eagle3_aux_layers(draft_config: Any, target_config: Any) -> tuple[int, ...]:
    """The target layers whose input residual stream the head reads (N: the last
    layer's output): the config's, else vLLM's (2, N // 2, N - 3), kept in [0, N]."""
    ids = getattr(draft_config, "eagle_aux_hidden_state_layer_ids", None)
    n = target_config.num_hidden_layers
    if not ids:
        ids = (min(2, n), n // 2, max(n - 3, 0))
    bad = [i for i in ids if not 0 <= i <= n]
    if bad:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(ids)}: {bad} outside the "
                         f"target's {n} layers")
    return tuple(ids)


def eagle3_specs(draft_config: Any, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
    return attention_specs(draft_config, dtype, block_size)[:1]
