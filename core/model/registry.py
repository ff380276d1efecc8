"""Which family runs which HF checkpoint, by the config's `model_type`.

Families are found, never listed: every module of the package `tokenmill.model.families`
that defines `FAMILY` (a `ModelFamily`) is one, and so is every `ModelFamily` an entry
point of the group `tokenmill.model_families` names (a family shipped outside the core, or
a test's). Keyed by model_type, not `architectures`, because the classes read their
per-type switches from model_type. Two families claiming one model_type is an error
naming both.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import sys
from importlib import metadata
from typing import Any

import torch

from tokenmill.model import families as families_package
from tokenmill.model.family import ModelFamily
from tokenmill.model.kv_scales import with_kv_cache_dtype
from tokenmill.platforms.interfaces import AttentionSpec

ENTRY_POINT_GROUP = "tokenmill.model_families"


def builtin_families() -> list[ModelFamily]:
    """The `FAMILY` of every module of `tokenmill.model.families`, by module name."""
    found = []
    for info in sorted(pkgutil.iter_modules(families_package.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{families_package.__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if family is not None:
            found.append(_checked(family, module.__name__))
    return found


def entry_point_families() -> list[ModelFamily]:
    """The families named by entry points of the group `tokenmill.model_families`
    (the distributions on `sys.path`: read once per path, a scan takes ~20 ms)."""
    return list(_entry_point_families(tuple(sys.path)))


@functools.lru_cache(maxsize=4)
def _entry_point_families(path: tuple[str, ...]) -> tuple[ModelFamily, ...]:
    found = []
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            family = entry_point.load()
        except ImportError as exc:
            raise ImportError(
                f"model family entry point {entry_point.name!r} ({entry_point.value!r}) "
                f"cannot be imported: {exc}"
            ) from exc
        found.append(_checked(family, f"entry point {entry_point.name!r}"))
    return tuple(found)


def families() -> dict[str, ModelFamily]:
    """model_type -> family, over every family found (see the module docstring)."""
    by_type: dict[str, ModelFamily] = {}
    for family in builtin_families() + entry_point_families():
        for model_type in family.model_types:
            other = by_type.get(model_type)
            if other is not None and other is not family:
                raise ValueError(
                    f"model_type {model_type!r} is claimed by two model families, "
                    f"{other.name!r} and {family.name!r}; uninstall one"
                )
            by_type[model_type] = family
    return by_type


def supported_model_types() -> list[str]:
    return sorted(families())


def family_for(hf_config: Any) -> ModelFamily:
    """The family that runs `hf_config`.

    Raises ValueError naming the model type, the config's architectures and the supported list.
    """
    model_type = getattr(hf_config, "model_type", None)
    found = families()
    if model_type in found:
        return found[model_type]
    architectures = list(getattr(hf_config, "architectures", None) or [])
    raise ValueError(
        f"model_type {model_type!r} (architectures {architectures}) is not supported; "
        f"supported model types: {sorted(found)}"
    )


def model_class_for(hf_config: Any) -> type:
    """The class that builds `hf_config`'s model (its family's)."""
    return family_for(hf_config).model


def attention_specs_for(
    hf_config: Any, dtype: torch.dtype, block_size: int, kv_cache_dtype: torch.dtype | None = None
) -> list[AttentionSpec]:
    """One attention spec per layer of `hf_config`, as its family builds them, attention
    caches in `kv_cache_dtype` when set (a quantized KV cache)."""
    return with_kv_cache_dtype(
        family_for(hf_config).attention_specs(hf_config, dtype, block_size), kv_cache_dtype
    )


def check_sequence_parallel(hf_config: Any) -> None:
    """ValueError naming the model types that support sequence parallel when
    `hf_config`'s family does not."""
    if not family_for(hf_config).sequence_parallel:
        supported = sorted(t for t, f in families().items() if f.sequence_parallel)
        raise ValueError(
            f"enable_sequence_parallelism supports model types {supported}, not "
            f"{hf_config.model_type!r}"
        )


def _checked(family: Any, source: str) -> ModelFamily:
    if not isinstance(family, ModelFamily):
        raise TypeError(f"{source}: FAMILY is a {type(family).__name__}, not a ModelFamily")
    if not family.model_types:
        raise ValueError(f"{source}: model family {family.name!r} names no model_type")
    return family
