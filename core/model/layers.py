"""Backend-neutral layers of the model graph.

Layers hold weights and call the resolved `Ops` (norms, rotary, activation) and the platform's
`AttentionBackend`; they never name a device or a vendor. Dense matmuls are `F.linear`, which
every torch backend implements.

Fused projections (`MergedLinear`) keep one weight for several checkpoint tensors (q/k/v,
gate/up) so each layer runs one matmul where the checkpoint has several; `load_shard` copies a
checkpoint tensor into its slice.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.ops import Ops
from tokenmill.ops.linear_attention import ReferenceLinearAttentionBackend
from tokenmill.ops.mla import ReferenceMLABackend
from tokenmill.ops.reference import ReferenceAttentionBackend
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.registry import PlatformError

logger = logging.getLogger(__name__)


class Linear(nn.Module):
    """y = x @ W.T (+ b). Weights start uninitialised: the checkpoint fills them, and a random
    init of a large model would cost seconds for nothing."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self._apply_packed = None

    def prepack(self, ops: Ops) -> None:
        """Let the platform repack the loaded weights (`ops.prepack_linear`); call after every
        weight update. Until then, and for weights changed later, forward uses F.linear."""
        self._apply_packed = ops.prepack_linear(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._apply_packed is not None:
            return self._apply_packed(x)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """A `Linear` whose weight stacks several checkpoint matrices along the output dim.

    `output_sizes` are the row counts of the stacked matrices, in order (q, k, v or gate, up).
    """

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], bias: bool, dtype: torch.dtype
    ) -> None:
        self.output_sizes = list(output_sizes)
        self.offsets = [0]
        for size in self.output_sizes:
            self.offsets.append(self.offsets[-1] + size)
        super().__init__(in_features, self.offsets[-1], bias, dtype)

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy `tensor` into rows of shard `shard` of `weight` or `bias` (cast to its dtype)."""
        param = getattr(self, param_name)
        lo, hi = self.offsets[shard], self.offsets[shard + 1]
        target = param.data[lo:hi]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"shard {shard} of {param_name} expects shape {tuple(target.shape)}, "
                f"got {tuple(tensor.shape)}"
            )
        target.copy_(tensor)


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden], uninitialised until loaded."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


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


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's rotary parameters as one dict with at least `rope_theta` and `rope_type`.

    transformers >= 5 keeps them in `config.rope_parameters`; older configs have `rope_theta`
    beside an optional `rope_scaling` dict (whose type key was once `type`). Both are read.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, a smooth band between.

    Same arithmetic as transformers' `_compute_llama3_parameters`, so tables match bit for bit.
    """
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    params: Mapping[str, Any], rotary_dim: int, max_position: int, device: torch.device | None
) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, DeepSeek): frequencies blended between interpolated and extrapolated
    along a ramp over the dimensions, and the factor that scales cos and sin.

    Same arithmetic as transformers' `_compute_yarn_parameters`.
    """
    base, dim = params["rope_theta"], rotary_dim
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low))
    extrapolation = 1 - ramp.clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def build_cos_sin_cache(
    params: Mapping[str, Any], rotary_dim: int, max_position: int, device: torch.device | None
) -> torch.Tensor:
    """float32 [max_position, rotary_dim] table: cos of the angles | sin of the angles
    (both times YaRN's attention factor when the rope type is yarn).

    Float32 whatever the model dtype: bf16 angles lose whole radians past a few thousand
    positions.
    """
    rope_type = params["rope_type"]
    base = params["rope_theta"]
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (base ** (exponents / rotary_dim))
    scaling = 1.0
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    elif rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "yarn":
        inv_freq, scaling = _yarn_inv_freq(params, rotary_dim, max_position, device)
    elif rope_type != "default":
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return torch.cat((angles.cos() * scaling, angles.sin() * scaling), dim=-1)


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


class Attention(nn.Module):
    """Self-attention: fused qkv projection, optional per-head q/k norm, rotary, paged attention.

    The attention itself is the platform backend's; this layer only shapes its inputs.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        spec: AttentionSpec,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        ops: Ops,
        dtype: torch.dtype,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None,
        norm_cls: type[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_size = spec.head_size
        self.q_size = spec.num_heads * spec.head_size
        self.kv_size = spec.num_kv_heads * spec.head_size
        self.qkv_proj = MergedLinear(
            hidden_size, [self.q_size, self.kv_size, self.kv_size], qkv_bias, dtype
        )
        self.o_proj = Linear(self.q_size, hidden_size, o_bias, dtype)
        # Qwen3 and Gemma 3 normalise each head's q and k before rotary (`norm_cls`: the
        # family's RMSNorm; default the llama one).
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            norm_cls = norm_cls or RMSNorm
            self.q_norm = norm_cls(spec.head_size, qk_norm_eps, ops, dtype)
            self.k_norm = norm_cls(spec.head_size, qk_norm_eps, ops, dtype)
        # gpt-oss: one learned sink logit per head (see AttentionSpec.sinks)
        self.sinks = nn.Parameter(torch.empty(spec.num_heads, dtype=dtype)) if spec.sinks else None
        # Plain attributes, not submodules: the rotary table is shared by every layer.
        self.__dict__["rotary"] = rotary
        self.backend = backend

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
        if self.sinks is None:
            out = self.backend.forward(self.spec, q, k, v, kv_cache, metadata)
        else:
            sinks = self.sinks.float()
            out = self.backend.forward(self.spec, q, k, v, kv_cache, metadata, sinks=sinks)
        return self.o_proj(out.reshape(-1, self.q_size))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, ops: Ops, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, [intermediate_size, intermediate_size], bias, dtype
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype)
        self.ops = ops

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
        return backend if sinks_ok and backend.supports(spec) else None

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
