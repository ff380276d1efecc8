"""Kimi Delta Attention (KDA, Kimi Linear) on Triton: the chunked scan (prefill) and the
recurrence (decode) of the gated delta rule with one decay per key channel, which are the
kernels of `tokenmill_triton.delta_rule` with the per-channel gate switched on (Gated
DeltaNet runs the same kernels with one decay per head). The causal conv in front is
`tokenmill_triton.gated_delta.causal_conv1d` (the same op).

The references are `tokenmill.platforms.ops.kda` (one sequence at a time, float32 math). Shapes as
the Gated DeltaNet kernels except the decay, one per key channel:

    q, k [T, Hk, dk], v [T, Hv, dv], g float32 [T, Hv, dk], beta [T, Hv],
    states float32 [N, Hv, dk, dv] (updated in place)
"""

from __future__ import annotations

import functools

from tokenmill_triton import delta_rule

# `tokenmill.platforms.ops.kda.kda_chunked` / `kda_recurrent` for every sequence of the
# step: the delta-rule kernels with g [T, Hv, dk] (signatures and shapes:
# tokenmill_triton.delta_rule.chunked / .recurrent)
kda_chunked = functools.partial(delta_rule.chunked, per_channel=True)
kda_recurrent = functools.partial(delta_rule.recurrent, per_channel=True)
