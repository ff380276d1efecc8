"""Backend-neutral layers of the model graph shared by the families.

Layers hold weights and call the resolved `Ops` (norms, rotary, activation) and the platform's
`AttentionBackend`; they never name a device or a vendor. Their matmuls are built through the
model's `LayerBuilder` (core/model/linear.py), at this rank's shapes, in each layer's weight
scheme. Fused projections keep one weight for several checkpoint tensors (q/k/v, gate/up)
so each layer runs one matmul where the checkpoint has several.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tokenmill.model.kv_scales import add_kv_scales, kv_cache_args
from tokenmill.model.linear import LayerBuilder
from tokenmill.model.parallel import Slice
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.ops import Ops
from tokenmill.platforms.ops.linear_attention import ReferenceLinearAttentionBackend
from tokenmill.platforms.ops.mla import ReferenceMLABackend
from tokenmill.platforms.ops.reference import ReferenceAttentionBackend
from tokenmill.platforms.ops.rotary import build_cos_sin_cache, rope_parameters
from tokenmill.platforms.registry import PlatformError

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """RMS norm over the last dim; with `residual`, adds it first and returns the new residual."""

    def __init__(self, hidden_size: int, eps: float, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """y = x / rms(x) * (1 + weight) in float32, cast back to x's dtype; with `residual`,
    adds it first and also returns the sum (the new residual). Gemma's norm, also
    Qwen3-Next's."""

    def __init__(self, hidden_size: int, eps: float, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.eps = eps
        self.ops = ops

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over the first `rotary_dim` channels of each head.

    The cos/sin table is a float32 buffer shared by every layer's attention; it stays float32
    when the module is cast (casting rebuilds it from the parameters rather than keep a
    rounded copy).
    """

    def __init__(self, params: Mapping[str, Any], rotary_dim: int, max_position: int, ops: Ops):
        super().__init__()
        self.params = dict(params)
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.ops = ops
        cache = build_cos_sin_cache(self.params, rotary_dim, max_position, device=None)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:
            device = self.cos_sin_cache.device
            self.cos_sin_cache = build_cos_sin_cache(
                self.params, self.rotary_dim, self.max_position, device
            )
        return self

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rotary_embedding(positions, query, key, self.cos_sin_cache)


def rotary_from_config(hf_config: Any, ops: Ops) -> RotaryEmbedding:
    """The model's rotary table over `partial_rotary_factor` of each attention head (the
    head size from the config: a pipeline stage may hold no attention layer)."""
    head_size = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    params = rope_parameters(hf_config)
    rotary_dim = int(head_size * params.get("partial_rotary_factor", 1.0))
    return RotaryEmbedding(params, rotary_dim, hf_config.max_position_embeddings, ops)


def add_norm(
    norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm layer's input: (norm(hidden), hidden) in the first layer, where there is
    no residual stream yet; else the norm of hidden + residual, and that sum."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class Attention(nn.Module):
    """Self-attention: fused qkv projection, optional per-head q/k norm, rotary, paged attention.

    The attention itself is the platform backend's; this layer only shapes its inputs.
    Under tensor parallel `spec` holds this rank's heads: qkv is column-parallel (its KV
    heads replicated when there are fewer than ranks), o_proj row-parallel, the sinks
    split by head.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        spec: AttentionSpec,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        build: LayerBuilder,
        prefix: str,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None,
        norm_cls: type[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        ops, dtype = build.ops, build.dtype
        self.spec = spec
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_size = spec.head_size
        self.q_size = spec.num_heads * spec.head_size
        self.kv_size = spec.num_kv_heads * spec.head_size
        sizes = self.qkv_sizes()
        self.qkv_proj = build.column(
            f"{prefix}.qkv_proj", hidden_size, sizes, qkv_bias,
            shards=build.attention_shards(sizes[0], spec.head_size), gather=True,
        )
        self.o_proj = build.row(f"{prefix}.o_proj", self.q_size, hidden_size, o_bias)
        # Qwen3 and Gemma 3 normalise each head's q and k before rotary (`norm_cls`: the
        # family's RMSNorm; default the llama one).
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            norm_cls = norm_cls or RMSNorm
            self.q_norm = norm_cls(spec.head_size, qk_norm_eps, ops, dtype)
            self.k_norm = norm_cls(spec.head_size, qk_norm_eps, ops, dtype)
        # gpt-oss: one learned sink logit per head (see AttentionSpec.sinks)
        self.sinks = nn.Parameter(torch.empty(spec.num_heads, dtype=dtype)) if spec.sinks else None
        rank = build.tp.rank_in_group
        self.shard_rules = build.rules(
            {"sinks": Slice(0, rank * spec.num_heads, spec.num_heads)} if spec.sinks else {}
        )
        add_kv_scales(self, spec)  # a quantized KV cache's k_scale / v_scale buffers
        # Plain attributes, not submodules: the rotary table is shared by every layer.
        self.__dict__["rotary"] = rotary
        self.backend = backend

    def qkv_sizes(self) -> list[int]:
        """The rows of the fused projection's parts: q, k, v (a family may widen q)."""
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_size)
        k = k.view(-1, self.num_kv_heads, self.head_size)
        v = v.view(-1, self.num_kv_heads, self.head_size)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        spec, extra = kv_cache_args(self, k, v)  # an FP8 cache's scales (or calibration)
        if self.sinks is not None:
            extra["sinks"] = self.sinks.float()
        out = self.backend.forward(spec, q, k, v, kv_cache, metadata, **extra)
        return self.o_proj(out.reshape(-1, self.q_size))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul.

    Under tensor parallel `intermediate_size` is this rank's: gate/up column-parallel,
    down row-parallel. `partial` (a MoE's shared experts): down's output stays this
    rank's partial sum, for the caller to reduce, and the input is not gathered under
    sequence parallel (the caller hands it every token)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, build: LayerBuilder,
        prefix: str, *, partial: bool = False,
    ) -> None:
        super().__init__()
        self.gate_up_proj = build.column(
            f"{prefix}.gate_up_proj", hidden_size, [intermediate_size, intermediate_size], bias,
            gather=not partial,
        )
        self.down_proj = build.row(f"{prefix}.down_proj", intermediate_size, hidden_size, bias,
                                   reduce=not partial)
        self.ops = build.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


BackendChoice = AttentionBackend | Callable[[AttentionSpec], AttentionBackend]


def resolve_backends(specs: Sequence[AttentionSpec], choice: BackendChoice) -> list[AttentionBackend]:
    """The attention backend of each layer: `choice` is one backend for every layer or a
    chooser per spec (a platform picks by kind; it raises PlatformError when it has none).

    A layer whose spec asks for a feature the platform's backends lack (sinks) but whose
    plain spec they support runs on the core's reference attention instead, with a
    warning naming the layers; so does an MLA layer on a platform without an MLA backend
    (the core's reference MLA); anything else unsupported is a ValueError naming the layer.
    """
    choose = choice if not isinstance(choice, AttentionBackend) else lambda spec: choice

    def supported(spec: AttentionSpec) -> AttentionBackend | None:
        try:
            backend = choose(spec)
        except PlatformError:
            return None
        sinks_ok = not spec.sinks or backend.supports_sinks
        # a quantized cache only on a backend that declares its dtype (older plugins'
        # `supports` never looked at cache_dtype)
        kv_ok = spec.cache_dtype is None or spec.cache_dtype in backend.kv_cache_dtypes
        return backend if sinks_ok and kv_ok and backend.supports(spec) else None

    reference = ReferenceAttentionBackend()
    reference_mla = ReferenceMLABackend()
    backends, fallbacks, mla_fallbacks = [], [], []
    linear_reference = None
    for i, spec in enumerate(specs):
        backend = supported(spec)
        if backend is None and spec.sinks and supported(dataclasses.replace(spec, sinks=False)):
            backend = reference
            fallbacks.append(i)
        if backend is None and spec.kind == AttentionKind.MLA:
            backend = reference_mla
            mla_fallbacks.append(i)
        if backend is None and spec.kind == AttentionKind.LINEAR:
            # the core's reference recurrence (slow) when the platform has none
            linear_reference = linear_reference or ReferenceLinearAttentionBackend()
            if linear_reference.supports(spec):
                backend = linear_reference
                logger.warning("the platform has no linear-attention backend for layer %d "
                               "(variant %r): it runs the core's reference", i,
                               spec.state.variant)
        if backend is None:
            raise ValueError(f"no attention backend supports layer {i}'s spec {spec}")
        backends.append(backend)
    if fallbacks:
        logger.warning(
            "the platform's attention has no sinks: layers %s run the core's reference "
            "attention (slow)",
            fallbacks,
        )
    if mla_fallbacks:
        logger.warning(
            "the platform has no MLA attention backend: layers %s run the core's reference "
            "MLA (slow)",
            mla_fallbacks,
        )
    return backends
