"""What the registry checks of the objects a platform plugin returns, each failure a
`PlatformError` naming the plugin; and the version checks: nothing the plugin declares
or serves may be newer than its declared plugin API version
(tokenmill.platforms.versions)."""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.platforms.interfaces import (
    OP_NAMES,
    Allocator,
    AllocatorPurpose,
    AttentionBackend,
    AttentionKind,
    Capabilities,
    HardwareSpec,
    KVCacheLayout,
    ModelRunnerBase,
    Platform,
    RunnerCapabilities,
)
from tokenmill.platforms.ops.kv_quant import QUANTIZED_KV_DTYPES
from tokenmill.platforms.plugins import PluginError, check_since
from tokenmill.platforms.versions import ATTENTION_KINDS_SINCE, FIELDS_SINCE, OPS_SINCE


class PlatformError(PluginError):
    """A platform plugin is missing, broken, unavailable or cannot be chosen."""


def check_type(name: str, hook: str, value: object, expected: type) -> object:
    """`value` if it is an `expected`, else a PlatformError naming the plugin and the hook."""
    if not isinstance(value, expected):
        raise PlatformError(
            f"platform plugin {name!r}: {hook} returned {value!r} "
            f"({type(value).__name__}); expected {expected.__name__}"
        )
    return value


def check_platform(name: str, platform: object) -> Platform:
    """A `Platform` with names, non-empty capabilities and a declared default dtype."""
    check_type(name, "tokenmill_platform", platform, Platform)
    assert isinstance(platform, Platform)
    problems = []
    for field_name in ("name", "device_type"):
        value = getattr(platform, field_name)
        if not isinstance(value, str) or not value:
            problems.append(f"{field_name}={value!r} must be a non-empty string")
    caps = platform.capabilities
    if not isinstance(caps, Capabilities):
        problems.append(f"capabilities={caps!r} must be a Capabilities")
    else:
        for field_name in ("attention_kinds", "dtypes", "block_sizes", "head_sizes"):
            if not getattr(caps, field_name):
                problems.append(f"capabilities.{field_name} is empty")
        if any(not isinstance(b, int) or b <= 0 for b in caps.block_sizes):
            problems.append(f"capabilities.block_sizes={sorted(caps.block_sizes)} must be > 0")
        if platform.default_dtype not in caps.dtypes:
            problems.append(f"default_dtype={platform.default_dtype} is not in capabilities.dtypes")
    if not callable(platform.memory_info):
        problems.append(f"memory_info={platform.memory_info!r} must be callable")
    if problems:
        raise PlatformError(f"platform plugin {name!r} returned a bad Platform: {problems}")
    return platform


def check_backends(name: str, platform: Platform, backends: object) -> list[AttentionBackend]:
    """Backends that cover exactly the attention kinds the platform declares."""
    hook = "tokenmill_attention_backends"
    if not isinstance(backends, (list, tuple)) or not backends:
        raise PlatformError(
            f"platform plugin {name!r}: {hook} returned {backends!r}; expected a non-empty list"
        )
    for backend in backends:
        check_type(name, hook, backend, AttentionBackend)
    declared = platform.capabilities.attention_kinds
    kinds = {backend.kind for backend in backends}
    if kinds - declared or declared - kinds:
        raise PlatformError(
            f"platform plugin {name!r}: backends cover attention kinds "
            f"{sorted(k.value for k in kinds)} but the platform declares "
            f"{sorted(k.value for k in declared)}; they must be equal"
        )
    _check_kv_cache_dtypes(name, platform, backends)
    return list(backends)


def _check_kv_cache_dtypes(name: str, platform: Platform, backends: list) -> None:
    """A platform's declared quantized KV dtypes are FP8 ones its backends of every
    attention kind but LINEAR (whose states are not quantized) store."""
    declared = platform.capabilities.kv_cache_dtypes
    unknown = set(declared) - QUANTIZED_KV_DTYPES
    if unknown:
        raise PlatformError(
            f"platform plugin {name!r} declares kv_cache_dtypes {sorted(map(str, unknown))}; "
            f"the core knows {sorted(map(str, QUANTIZED_KV_DTYPES))}"
        )
    for backend in backends:
        missing = set(declared) - set(backend.kv_cache_dtypes)
        if backend.kind != AttentionKind.LINEAR and missing:
            raise PlatformError(
                f"platform plugin {name!r} declares kv_cache_dtypes {sorted(map(str, missing))} "
                f"that its {backend.kind.value} backend {backend.name!r} does not store "
                "(AttentionBackend.kv_cache_dtypes)"
            )


def check_ops(name: str, ops: object) -> dict[str, Callable]:
    """Op overrides: known op names to callables ({} for none)."""
    if ops is None:
        return {}
    if not isinstance(ops, dict):
        raise PlatformError(
            f"platform plugin {name!r}: tokenmill_ops returned {ops!r}; "
            "expected a dict of op name -> function"
        )
    unknown = set(ops) - OP_NAMES
    if unknown:
        raise PlatformError(
            f"platform plugin {name!r} overrides unknown ops {sorted(unknown)}; known ops "
            f"are {sorted(OP_NAMES)}"
        )
    not_callable = sorted(op for op, fn in ops.items() if not callable(fn))
    if not_callable:
        raise PlatformError(f"platform plugin {name!r}: ops {not_callable} are not callable")
    return ops


def check_runner(where: str, runner: object) -> ModelRunnerBase:
    """A `ModelRunnerBase` whose capabilities and KV layout are well formed."""
    if not isinstance(runner, ModelRunnerBase):
        raise PlatformError(f"{where}: tokenmill_model_runner returned {runner!r} "
                            f"({type(runner).__name__}); expected a ModelRunnerBase")
    caps = runner.capabilities()
    if not isinstance(caps, RunnerCapabilities) or not caps.attention_kinds or not all(
            isinstance(k, AttentionKind) for k in caps.attention_kinds):
        raise PlatformError(f"{where}: {type(runner).__name__}.capabilities() returned "
                            f"{caps!r}; expected a RunnerCapabilities naming its attention kinds")
    layout = runner.kv_cache_layout()
    problem = None
    if not isinstance(layout, KVCacheLayout) or not layout.attention_specs:
        problem = "expected a KVCacheLayout with one AttentionSpec per layer"
    elif layout.layer_slots is not None and len(layout.layer_slots) != len(layout.attention_specs):
        problem = f"{len(layout.layer_slots)} layer slots for {len(layout.attention_specs)} layers"
    elif layout.backends is not None and len(layout.backends) != len(layout.attention_specs):
        problem = f"{len(layout.backends)} backends for {len(layout.attention_specs)} layers"
    elif not isinstance(layout.reserved_blocks, int) or layout.reserved_blocks < 0:
        problem = f"reserved_blocks={layout.reserved_blocks!r} must be an int >= 0"
    if problem is not None:
        raise PlatformError(f"{where}: {type(runner).__name__}.kv_cache_layout() returned "
                            f"{layout!r}: {problem}")
    return runner


def check_allocator(name: str, purpose: AllocatorPurpose, allocator: object) -> Allocator:
    """An `Allocator` for the purpose asked, with a positive limit."""
    check_type(name, "tokenmill_allocator", allocator, Allocator)
    assert isinstance(allocator, Allocator)
    if allocator.purpose != purpose:
        raise PlatformError(
            f"platform plugin {name!r}: asked for a {purpose.value} allocator, got one for "
            f"{allocator.purpose!r}"
        )
    if allocator.bytes_limit() <= 0:
        raise PlatformError(
            f"platform plugin {name!r}: {purpose.value} allocator has bytes_limit "
            f"{allocator.bytes_limit()}; it must be positive"
        )
    return allocator


def check_hardware_spec(name: str, dtype_name: str, spec: object) -> HardwareSpec:
    """A `HardwareSpec` with positive figures and a peak for `dtype_name`."""
    check_type(name, "tokenmill_hardware_spec", spec, HardwareSpec)
    assert isinstance(spec, HardwareSpec)
    numbers = {f"peak_flops[{k!r}]": v for k, v in spec.peak_flops.items()}
    numbers["memory_bandwidth"] = spec.memory_bandwidth
    numbers["memory_bytes"] = spec.memory_bytes
    bad = {k: v for k, v in numbers.items() if not isinstance(v, (int, float)) or v <= 0}
    if dtype_name not in spec.peak_flops:
        bad[f"peak_flops[{dtype_name!r}]"] = "missing"
    if bad:
        raise PlatformError(f"platform plugin {name!r} returned a bad HardwareSpec: {bad}")
    return spec


def check_waivers(name: str, waivers: object) -> list[tuple[str, str]]:
    """(test id, reason) pairs of non-empty strings."""
    ok = isinstance(waivers, (list, tuple)) and all(
        isinstance(w, (list, tuple)) and len(w) == 2 and all(isinstance(s, str) and s for s in w)
        for w in waivers
    )
    if not ok:
        raise PlatformError(
            f"platform plugin {name!r}: tokenmill_waivers returned {waivers!r}; expected a "
            "list of (test id, reason) pairs of non-empty strings"
        )
    return [(test_id, reason) for test_id, reason in waivers]


def versioned_parts(
    platform: Platform, backends: list[AttentionBackend], ops: dict[str, Callable],
) -> list[tuple[str, str]]:
    """(what, the version that introduced it) for the attention kinds, ops and fields a
    platform plugin declares, serves or sets."""
    kinds = set(platform.capabilities.attention_kinds) | {b.kind for b in backends}
    parts = [(f"attention kind {k.value}", ATTENTION_KINDS_SINCE[k.value])
             for k in sorted(kinds, key=lambda k: k.value)]
    parts += [(f"op {op}", OPS_SINCE[op]) for op in sorted(ops)]
    parts += [(field, FIELDS_SINCE[field]) for field in _fields_used(platform, backends)]
    return parts


def check_versions(name: str, declared: str, parts: list[tuple[str, str]]) -> None:
    """Refuse any of `parts` newer than the plugin's declared version."""
    try:
        for what, since in parts:
            check_since(f"platform plugin {name!r}", declared, what, since)
    except PluginError as exc:
        raise PlatformError(str(exc)) from None


def _fields_used(platform: Platform, backends: list[AttentionBackend]) -> list[str]:
    """The versioned fields (FIELDS_SINCE) the plugin sets to a non-default value or
    overrides."""
    used = []
    if platform.capabilities.sleep_mode != Capabilities().sleep_mode:
        used.append("Capabilities.sleep_mode")
    if platform.long_prefill_token_threshold is not None:
        used.append("Platform.long_prefill_token_threshold")
    if platform.capabilities.kv_cache_dtypes:
        used.append("Capabilities.kv_cache_dtypes")
    for backend in backends:
        if backend.supports_sinks:
            used.append("AttentionBackend.supports_sinks")
        if backend.kv_cache_dtypes and platform.capabilities.kv_cache_dtypes:
            # the core hands a backend FP8 specs only where the platform declares them
            used.append("AttentionBackend.kv_cache_dtypes")
        if type(backend).kv_cache_shape is not AttentionBackend.kv_cache_shape:
            used.append("AttentionBackend.kv_cache_shape")
    return sorted(set(used))


