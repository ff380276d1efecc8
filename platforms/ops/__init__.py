"""The ops the model graph calls, resolved once per engine: platform overrides on top of
the core's pure-PyTorch references."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tokenmill.platforms.interfaces import OP_NAMES
from tokenmill.platforms.ops import reference
from tokenmill.platforms.ops.quant import ReferenceQuantizedLinear


@dataclass(frozen=True, slots=True)
class Ops:
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    gelu_tanh_and_mul: Callable
    moe_experts: Callable
    prepack_linear: Callable
    prepack_quantized_linear: Callable
    copy_blocks: Callable
    swap_blocks: Callable
    apply_token_bitmask: Callable


def resolve_ops(overrides: Mapping[str, Callable] | None = None, source: str = "platform") -> Ops:
    """Reference ops with `overrides` (op name -> function) replacing them by name.

    An unknown op name is an error naming the op and `source`, so a plugin typo cannot
    silently fall back to the reference. Without a `prepack_quantized_linear` of the
    platform's own, the reference's is wrapped to log, once per scheme, that `source`
    runs quantized layers through it (`ReferenceQuantizedLinear`).
    """
    overrides = dict(overrides or {})
    unknown = set(overrides) - OP_NAMES
    if unknown:
        raise ValueError(
            f"{source} overrides unknown ops {sorted(unknown)}; known ops are {sorted(OP_NAMES)}"
        )
    fallback = {"prepack_quantized_linear": ReferenceQuantizedLinear(source)}
    table = {**reference.REFERENCE_OPS, **fallback, **overrides}
    return Ops(**{name: table[name] for name in Ops.__slots__})
