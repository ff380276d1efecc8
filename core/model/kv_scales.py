"""The scales of a quantized (FP8) KV cache, per attention layer.

Each attention layer whose spec sets `cache_dtype` keeps two float32 buffers, `k_scale`
and `v_scale`, one value per KV head on this rank ([num_kv_heads]; MLA: [1], the latent
row's), and hands them to its backend (`AttentionBackend.forward`'s keywords). They are
1.0 unless the checkpoint carries them: vLLM's names `<layer>.self_attn.k_scale` /
`v_scale` (or one `kv_scale` for both), a scalar per layer or one value per KV head. A
checkpoint's scales for a model whose cache is not quantized are skipped (as vLLM does).
Uncalibrated scales of 1.0 are vLLM's default too: FP8 e4m3 holds +-448, but keys and
values much smaller than 1 then fall into e4m3's subnormals (docs/quantized-kv.md).

Calibrated scales (`calculate_kv_scales`, as vLLM names it): `calibrate_kv_scales` runs a
forward pass given by the caller (the runner's prefill of a fixed sample on scratch pages
in the compute dtype) during which every quantized layer calls its backend with its plain
spec (no quantization) and records the largest |k| and |v| of each KV head; then each
layer's scales become amax / the format's largest value (`tokenmill.platforms.ops.
kv_quant.calibrated_scales`). That happens once, before the KV arena exists, so no stored
KV is ever read with other scales than it was written with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable

import torch
from torch import nn

from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
from tokenmill.platforms.ops.kv_quant import calibrated_scales, head_amax, unit_scales

logger = logging.getLogger(__name__)

SCALE_NAMES = ("k_scale", "v_scale", "kv_scale")


def add_kv_scales(module: nn.Module, spec: AttentionSpec) -> None:
    """Give `module` (an attention layer) its scale buffers when `spec`'s cache is quantized."""
    if spec.cache_dtype is None:
        return
    module.register_buffer("k_scale", unit_scales(spec.num_kv_heads), persistent=False)
    module.register_buffer("v_scale", unit_scales(spec.num_kv_heads), persistent=False)
    # while `calibrate_kv_scales` runs: the amax the layer has seen (KVAmax); else None
    module.kv_amax = None


@dataclasses.dataclass(slots=True)
class KVAmax:
    """The largest |key| and |value| per KV head a layer was given while calibrating."""

    k: torch.Tensor  # float32 [num_kv_heads] (MLA: [1], the latent row)
    v: torch.Tensor  # float32 [num_kv_heads] (MLA: unused, stays 0)
    num_tokens: int = 0  # tokens observed

    def observe(self, key: torch.Tensor, value: torch.Tensor | None) -> None:
        self.num_tokens += key.shape[0]
        self.k = torch.maximum(self.k, head_amax(key).to(self.k.device))
        if value is not None:
            self.v = torch.maximum(self.v, head_amax(value).to(self.v.device))


def kv_scale_kwargs(module: nn.Module) -> dict[str, torch.Tensor]:
    """The `k_scale` / `v_scale` keywords of `module`'s backend call ({} when unquantized)."""
    k_scale = getattr(module, "k_scale", None)
    return {} if k_scale is None else {"k_scale": k_scale, "v_scale": module.v_scale}


def kv_cache_args(
    module: nn.Module, key: torch.Tensor, value: torch.Tensor | None
) -> tuple[AttentionSpec, dict[str, torch.Tensor]]:
    """The spec and scale keywords of `module`'s backend call storing `key` / `value`: its
    spec with its scales (none when unquantized); while calibrating, its plain spec (the
    cache in the compute dtype) without scales, after recording the step's amax per head."""
    amax = getattr(module, "kv_amax", None)
    if amax is None:
        return module.spec, kv_scale_kwargs(module)
    amax.observe(key, value)
    return dataclasses.replace(module.spec, cache_dtype=None), {}


def quantized_kv_layers(model: nn.Module) -> list[nn.Module]:
    """The attention layers of `model` whose KV cache is quantized (they hold scales)."""
    return [m for m in model.modules() if getattr(m, "k_scale", None) is not None]


def calibrate_kv_scales(layers: list[nn.Module], forward: Callable[[], object]) -> None:
    """Set the k / v scales of `layers` (`quantized_kv_layers`) from the amax per KV head
    they observe during `forward()`, a pass of the model whose attention stores KV in the
    compute dtype (scratch pages of the layers' plain specs): scale = amax / the cache
    format's largest value (`calibrated_scales`). ValueError naming a layer that saw no
    token. The layers are back to their quantized path afterwards, whatever happens."""
    for layer in layers:
        zeros = torch.zeros_like(layer.k_scale)
        layer.kv_amax = KVAmax(zeros, torch.zeros_like(layer.v_scale))
    try:
        forward()
        amaxes = [layer.kv_amax for layer in layers]
    finally:
        for layer in layers:
            layer.kv_amax = None
    for layer, amax in zip(layers, amaxes, strict=True):
        if amax.num_tokens == 0:
            raise ValueError(f"{type(layer).__name__} {layer.spec}: the calibration pass "
                             "stored no KV in this layer; its scales cannot be calibrated")
        cache_dtype = layer.spec.cache_dtype
        layer.k_scale.copy_(calibrated_scales(amax.k, cache_dtype))
        if layer.spec.kind != AttentionKind.MLA:  # MLA: one scale, the latent row's
            layer.v_scale.copy_(calibrated_scales(amax.v, cache_dtype))


def kv_scales_digest(layers: list[nn.Module]) -> str:
    """A hex digest of the scales of `layers`, in order (what stored KV was divided by)."""
    h = hashlib.sha256()
    for layer in layers:
        for scale in (layer.k_scale, layer.v_scale):
            h.update(scale.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def is_kv_scale(hf_name: str) -> bool:
    """Whether a checkpoint tensor is a KV cache scale (`...self_attn.k_scale`)."""
    return hf_name.rpartition(".")[2] in SCALE_NAMES


def load_kv_scale(modules: dict[str, nn.Module], hf_name: str, tensor: torch.Tensor) -> bool:
    """Copy a checkpoint's KV scale into its layer's buffer(s); whether it was used (False:
    the layer's cache is not quantized). KeyError naming the tensor when no layer of that
    name exists; ValueError naming its shape when it is neither a scalar nor one value per
    KV head of the layer."""
    module_name, _, which = hf_name.rpartition(".")
    module = modules.get(module_name)
    if module is None:
        raise KeyError(f"checkpoint KV scale {hf_name!r} names no attention layer "
                       f"{module_name!r} of this model")
    if getattr(module, "k_scale", None) is None:
        logger.debug("%s skipped: the layer's KV cache is not quantized", hf_name)
        return False
    targets = [module.k_scale, module.v_scale] if which == "kv_scale" else [getattr(module, which)]
    values = tensor.detach().float().flatten()
    if values.numel() not in (1, targets[0].numel()):
        raise ValueError(
            f"checkpoint KV scale {hf_name!r} has {values.numel()} values; expected one, or "
            f"one per KV head ({targets[0].numel()}) of this rank's layer"
        )
    if not torch.isfinite(values).all() or (values <= 0).any():
        raise ValueError(f"checkpoint KV scale {hf_name!r} holds {values.tolist()}; scales "
                         "must be finite and positive")
    for target in targets:
        target.copy_(values.expand(target.numel()))
    return True


def with_kv_cache_dtype(
    specs: list[AttentionSpec], cache_dtype: torch.dtype | None
) -> list[AttentionSpec]:
    """`specs` with every attention layer's cache in `cache_dtype` (None: unchanged); LINEAR
    layers keep their states' dtypes."""
    if cache_dtype is None:
        return specs
    return [
        s if s.kind == AttentionKind.LINEAR else dataclasses.replace(s, cache_dtype=cache_dtype)
        for s in specs
    ]
