"""Tensor parallelism by sharding: a 1-D device mesh and the layout of each weight on it.

Megatron's split, written as shardings for XLA's partitioner: q/k/v and gate/up are split
by output columns (heads, intermediate units), o and down by input rows, so each device
holds 1/N of every large matrix and XLA adds one all-reduce after o and one after down
(visible in the compiled HLO; tests/test_tpu_runner.py checks it). The KV cache is split
by KV heads when N divides them, else replicated (K/V projections then stay replicated
too: with fewer KV heads than devices each device needs whole heads). Embeddings and
norms are replicated.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tokenmill_tpu.model import ModelConfig

AXIS = "tp"

# layer weight -> the axis of its stacked [layers, ...] array that is split
_COLUMN = {"q": 2, "gate": 2, "up": 2, "q_bias": 1, "gate_bias": 1, "up_bias": 1}
_ROW = {"o": 1, "down": 1}
_KV = {"k": 2, "v": 2, "k_bias": 1, "v_bias": 1}


def make_mesh(size: int) -> Mesh:
    """A mesh of the first `size` JAX devices; ValueError when there are fewer."""
    devices = jax.devices()
    if not 1 <= size <= len(devices):
        raise ValueError(
            f"tensor_parallel_size={size} needs that many devices; JAX has {len(devices)} "
            "(on JAX's CPU backend set XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    return Mesh(np.array(devices[:size]), (AXIS,))


def _spec(ndim: int, axis: int | None) -> P:
    parts = [None] * ndim
    if axis is not None:
        parts[axis] = AXIS
    return P(*parts)


def kv_heads_split(mesh: Mesh, cfg: ModelConfig) -> bool:
    return cfg.num_kv_heads % mesh.size == 0


def shard_params(mesh: Mesh, cfg: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
    """`params` (numpy) placed on `mesh` with the split above (whole copies on 1 device)."""
    n = mesh.size
    split_kv = kv_heads_split(mesh, cfg)

    def place(array: np.ndarray, axis: int | None) -> jax.Array:
        if axis is not None and array.shape[axis] % n:
            axis = None  # does not divide: replicate
        return jax.device_put(array, NamedSharding(mesh, _spec(array.ndim, axis)))

    layers = {}
    for name, array in params["layers"].items():
        axis = _COLUMN.get(name, _ROW.get(name))
        if name in _KV:
            axis = _KV[name] if split_kv else None
        layers[name] = place(array, axis)
    top = {k: place(v, None) for k, v in params.items() if k != "layers"}
    return {**top, "layers": layers}


def kv_sharding(mesh: Mesh, cfg: ModelConfig, ndim: int, head_axis: int) -> NamedSharding:
    """How a KV array of `ndim` axes with KV heads on `head_axis` lies on `mesh`: split by
    KV heads (whole key/value pairs per device) where they divide, else replicated."""
    axis = head_axis if kv_heads_split(mesh, cfg) else None
    return NamedSharding(mesh, _spec(ndim, axis))
