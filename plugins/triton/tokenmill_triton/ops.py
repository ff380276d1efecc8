"""The `tokenmill_ops` table of a Triton plugin: the shared kernels bound to its launch
settings, under the core's op names and signatures."""

from __future__ import annotations

import functools
from collections.abc import Callable

from tokenmill_triton.configs import KernelConfigs


def make_ops(configs: KernelConfigs, platform: str) -> dict[str, Callable]:
    """Op name -> kernel wrapper with the reference's signature (tokenmill.platforms.ops.reference).

    prepack_linear, copy_blocks and swap_blocks stay the core's references: they are one
    vendor GEMM or one indexed copy each already. moe_experts is the grouped-GEMM kernel
    (rounding to the dtype where the reference rounds; in the interpreter bf16 casts are
    rounded to nearest even in-kernel, see tokenmill_triton.rounding).
    prepack_quantized_linear runs int4 and FP8 weights on the weight-only GEMM
    (tokenmill_triton.quant) and hands other schemes to the core's reference, which logs
    once per scheme naming `platform` (the plugin's name)."""
    from tokenmill.platforms.ops.quant import ReferenceQuantizedLinear
    from tokenmill_triton import elementwise, moe, quant

    cfg = configs.elementwise
    return {
        "gelu_tanh_and_mul": functools.partial(elementwise.gelu_tanh_and_mul, config=cfg),
        "rms_norm": functools.partial(elementwise.rms_norm, config=cfg),
        "fused_add_rms_norm": functools.partial(elementwise.fused_add_rms_norm, config=cfg),
        "rotary_embedding": functools.partial(elementwise.rotary_embedding, config=cfg),
        "silu_and_mul": functools.partial(elementwise.silu_and_mul, config=cfg),
        "apply_token_bitmask": functools.partial(elementwise.apply_token_bitmask, config=cfg),
        "moe_experts": functools.partial(moe.moe_experts, configs=configs),
        "prepack_quantized_linear": functools.partial(
            quant.prepack_quantized_linear, configs=configs,
            fallback=ReferenceQuantizedLinear(f"platform plugin {platform!r}")),
    }
