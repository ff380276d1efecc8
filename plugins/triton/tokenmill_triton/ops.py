"""The `tokenmill_ops` table of a Triton plugin: the shared kernels bound to its launch
settings, under the core's op names and signatures."""

from __future__ import annotations

import functools
from collections.abc import Callable

from tokenmill_triton.configs import KernelConfigs


def make_ops(configs: KernelConfigs) -> dict[str, Callable]:
    """Op name -> kernel wrapper with the reference's signature (tokenmill.ops.reference).

    prepack_linear, copy_blocks and swap_blocks stay the core's references: they are one
    vendor GEMM or one indexed copy each already. moe_experts is not registered yet:
    `tokenmill_triton.moe.moe_experts` matches the reference in float32 and float16, but in
    bf16 the conformance suite's tolerance (atol 5e-2, rtol 3e-2 on outputs of magnitude
    ~16, where one bf16 step is 0.125) refuses any accumulation order other than the
    reference's where two experts' outputs cancel (5 of 672 elements in T1)."""
    from tokenmill_triton import elementwise

    cfg = configs.elementwise
    return {
        "gelu_tanh_and_mul": functools.partial(elementwise.gelu_tanh_and_mul, config=cfg),
        "rms_norm": functools.partial(elementwise.rms_norm, config=cfg),
        "fused_add_rms_norm": functools.partial(elementwise.fused_add_rms_norm, config=cfg),
        "rotary_embedding": functools.partial(elementwise.rotary_embedding, config=cfg),
        "silu_and_mul": functools.partial(elementwise.silu_and_mul, config=cfg),
        "apply_token_bitmask": functools.partial(elementwise.apply_token_bitmask, config=cfg),
    }
