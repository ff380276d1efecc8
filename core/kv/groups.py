"""KV groups: which layers share a block table, and which arena slot each layer uses.

Layers of one attention type (full attention, a sliding window of one size, or
multi-head latent attention) behave alike: they need the same blocks at the same time. Layers are split into groups of
equal size L, each group of one type; each group has its own block table per request.
The arena holds L layer slots; layer j of every group uses slot j. A block id names one
page in each of the L slots, and the pool hands each block to one (request, group) at a
time, so groups of different types share the slots' pages without ever overlapping.

L is the greatest common divisor of the per-type layer counts: every group is full and
no slot of any page is padding (Gemma 3's 5:1 sliding:global pattern gives L = the
global count's gcd with the sliding count; gpt-oss's 1:1 gives L = half the layers).
A model of one type has one group of all its layers: the layout of a plain model.

Recurrent layers (kind LINEAR: Gated DeltaNet, Mamba2, KDA) group the same way, by their
state spec: such a group holds, per running sequence, one state slot of `state_pages`
block ids (the packed state of one layer, `RecurrentStateSpec.num_bytes`, spread over
that many pages of its arena slot; only the last page's tail is unused) plus prefix-cache
checkpoints of the same size (core/kv/recurrent.py). Attention pages fix the page size;
a model with no attention layer gets pages of its largest state.

Pure Python with no device import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.platforms.interfaces import (
    AttentionKind,
    AttentionSpec,
    RecurrentStateSpec,
    kv_cache_shape,
)

# MLA layers keep one latent row per token for the whole context: their blocks are
# allocated like full attention's (by token count), in groups of their own (their pages
# hold other bytes than a multi-head layer's).
GROUPED_KINDS = (
    AttentionKind.FULL, AttentionKind.SLIDING_WINDOW, AttentionKind.LINEAR, AttentionKind.MLA
)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers with one block table. `layers[j]` (a model layer index) uses arena slot j."""

    group_id: int
    kind: AttentionKind
    sliding_window: int | None  # tokens; None for full attention
    layers: tuple[int, ...]
    state: RecurrentStateSpec | None = None  # LINEAR groups: each layer's per-sequence state
    state_pages: int = 0  # LINEAR groups: block ids one state (slot or checkpoint) takes


@dataclass(frozen=True, slots=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    num_slots: int  # L: layers per group = arena slots
    layer_group: tuple[int, ...]  # model layer -> its group id
    layer_slot: tuple[int, ...]  # model layer -> its arena slot
    page_bytes: int = 0  # bytes of one block id in one arena slot (0: not computed)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)


def plan_groups(specs: list[AttentionSpec]) -> KVLayout:
    """Group the layers of `specs` by attention type (kind and window), in layer order.

    Groups are numbered so that the group of layer 0's type comes first (for a plain
    model, group 0 is everything). Raises ValueError naming a layer whose kind has no
    block allocator.
    """
    if not specs:
        raise ValueError("the model declares no attention layers; nothing to cache")
    by_type: dict[tuple[AttentionKind, int | None, RecurrentStateSpec | None], list[int]] = {}
    for i, spec in enumerate(specs):
        if spec.kind not in GROUPED_KINDS:
            raise ValueError(
                f"layer {i} has attention kind {spec.kind.value!r}; the KV arena allocates "
                f"blocks for {[k.value for k in GROUPED_KINDS]} only"
            )
        window = spec.sliding_window if spec.kind == AttentionKind.SLIDING_WINDOW else None
        by_type.setdefault((spec.kind, window, spec.state), []).append(i)
    size = math.gcd(*(len(layers) for layers in by_type.values()))
    page = page_bytes_of(specs)
    groups: list[KVGroup] = []
    layer_group = [0] * len(specs)
    layer_slot = [0] * len(specs)
    for (kind, window, state), layers in by_type.items():
        pages = -(-state.num_bytes // page) if state is not None else 0
        for start in range(0, len(layers), size):
            members = tuple(layers[start : start + size])
            gid = len(groups)
            groups.append(KVGroup(gid, kind, window, members, state, pages))
            for slot, layer in enumerate(members):
                layer_group[layer], layer_slot[layer] = gid, slot
    return KVLayout(tuple(groups), size, tuple(layer_group), tuple(layer_slot), page)


def attention_page_bytes(spec: AttentionSpec) -> int:
    """Bytes of one block of one attention layer in the standard layout
    (`interfaces.kv_cache_shape`): its keys and values, or an MLA layer's latent rows."""
    return math.prod(kv_cache_shape(spec, 1)) * spec.kv_dtype.itemsize


def page_bytes_of(specs: list[AttentionSpec]) -> int:
    """The one page size of a model's layers: its attention layers' (they must agree), or,
    with none, the largest recurrent state rounded up to an even size (a page is two
    halves, keys and values, in the arena's layout)."""
    sizes = {attention_page_bytes(s) for s in specs if s.kind != AttentionKind.LINEAR}
    if len(sizes) > 1:
        raise ValueError(f"layers need different KV page sizes {sorted(sizes)}")
    if sizes:
        return sizes.pop()
    largest = max(s.state.num_bytes for s in specs)
    return largest + largest % 2
