"""A model family's descriptor: everything the core knows of one family, in one place.

Each family is one module of `tokenmill.model.families` that defines `FAMILY`, a
`ModelFamily` (found by scanning the package: core/model/registry.py); a family from
outside the core is a `ModelFamily` named by an entry point of the group
`tokenmill.model_families`. Nothing else in the core lists families: the engine, the
workers and the parallel code ask the descriptor of the checkpoint's `model_type`.

What a descriptor says:
- config mapping: the HF `model_type`s it runs, and the class that builds it
  (`model`, a `CausalLM` subclass whose `_convert` maps the checkpoint's weight names);
- layer kinds: `attention_specs(hf_config, dtype, block_size)`, one spec per layer;
- the shard plan: tensor parallel through `local_config` (the generic split of heads,
  KV heads, intermediate size and vocab, plus the family's `tp_shrink` for its own
  widths), expert parallel through `moe` (the config attributes of its experts), whether
  sequence and pipeline parallel apply, and the checkpoint prefix of the final norm
  (the last pipeline stage's);
- the tie rule (`ties_embeddings`) and the tiny-config shrink rule (`tiny`: a config of
  the family, shrunk to a few small layers of the same kinds, for tests).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.model.parallel import MoeSizes, local_config
from tokenmill.platforms.interfaces import AttentionSpec

SpecsFn = Callable[[Any, torch.dtype, int], list[AttentionSpec]]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One model family (see the module docstring)."""

    name: str
    model_types: tuple[str, ...]  # the HF config `model_type`s this family runs
    model: type  # the CausalLM subclass that builds it
    attention_specs: SpecsFn  # (hf_config, dtype, block_size) -> one spec per layer
    # (local copy, whole config, tp) -> None: shrinks the family's own widths in the
    # rank-local config and raises ValueError when one does not split
    tp_shrink: Callable[[Any, Any, int], None] | None = None
    moe: MoeSizes | None = None  # (experts' intermediate size attribute, expert count attribute)
    sequence_parallel: bool = True  # whether its layers take token slices between TP regions
    pipeline_parallel: bool = True  # whether its layers split into pipeline stages
    final_norm: str = "model.norm."  # checkpoint prefix of the final norm
    # whether `tie_word_embeddings` ties the LM head to the embedding, as transformers'
    # class for the family does (False: it keeps its own head whatever the config says)
    ties_embeddings: bool = True
    tiny: Callable[[Any], Any] | None = None  # a config of the family -> a tiny one
    # speculative decoding's draft models (core/model/draft.py): the class of the
    # checkpoint's multi-token-prediction module (`mtp`), and the EAGLE-3 draft head a
    # target of this family takes (`eagle3`); None: the method is refused for the family
    mtp: type | None = None
    eagle3: type | None = None

    def local_config(self, hf_config: Any, tp: int, expert_parallel: bool = False) -> Any:
        """`hf_config` at one tensor-parallel rank's shapes (tokenmill.model.parallel);
        ValueError naming the size that does not split over `tp` ranks."""
        return local_config(hf_config, tp, expert_parallel, moe=self.moe, shrink=self.tp_shrink)

    def head_is_tied(self, hf_config: Any) -> bool:
        """Whether this family, under `hf_config`, uses the embedding as its LM head."""
        return self.ties_embeddings and bool(getattr(hf_config, "tie_word_embeddings", False))


# per-layer lists of a config, cut with the layer count by `shrink_config`
_PER_LAYER = ("layer_types", "mlp_layer_types")


def shrink_config(hf_config: Any, **sizes: Any) -> Any:
    """`hf_config` rebuilt by its class with `sizes` (constructor argument -> value), so
    that what the class derives from them (head dims, layer patterns) follows. Its
    per-layer kind lists (`layer_types`, `mlp_layer_types`) are cut to the new
    `num_hidden_layers`, keeping every kind the whole list has."""
    cls = type(hf_config)
    accepted = set(inspect.signature(cls.__init__).parameters)
    kept = {k: v for k, v in hf_config.to_dict().items() if k in accepted}
    kept.update(sizes)
    num_layers = kept.get("num_hidden_layers", hf_config.num_hidden_layers)
    for name in _PER_LAYER:
        kinds = getattr(hf_config, name, None)
        if kinds and name in accepted and name not in sizes:
            kept[name] = keep_kinds(list(kinds), num_layers)
    return cls(**kept)


def keep_kinds(kinds: list[Any], n: int) -> list[Any]:
    """The first `n` of `kinds`, with each distinct kind of the whole list present: a kind
    missing from the first n replaces the last entry of a kind that is there twice."""
    distinct = list(dict.fromkeys(kinds))
    if n < len(distinct):
        raise ValueError(f"{n} layers cannot hold the {len(distinct)} layer kinds {distinct}")
    head = kinds[:n]
    for kind in distinct:
        if kind not in head:
            spare = max(i for i, k in enumerate(head) if head.count(k) > 1)
            head[spare] = kind
    return head
