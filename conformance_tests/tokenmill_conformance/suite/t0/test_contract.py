"""T0 contract: discovery, API version, hook names and signatures, returned objects."""

from __future__ import annotations

import dataclasses
import inspect
import time
from importlib import metadata

import pytest
import torch

from tokenmill.platforms import hookspecs
from tokenmill.platforms.interfaces import (
    OP_NAMES,
    PLUGIN_API_VERSION,
    Allocator,
    AllocatorPurpose,
    AttentionBackend,
    AttentionKind,
    AttentionSpec,
    Capabilities,
    Communicator,
    DetectionResult,
    HardwareSpec,
    MemoryInfo,
    MLADims,
    Platform,
)
from tokenmill_conformance.session import call_hook

HOOKSPECS = {
    name: function
    for name, function in inspect.getmembers(hookspecs, inspect.isfunction)
    if hasattr(function, f"{hookspecs.PROJECT_NAME}_spec")
}


def _hooks(plugin: object) -> dict[str, object]:
    return {
        name: getattr(plugin, name)
        for name in dir(plugin)
        if name.startswith("tokenmill_") and callable(getattr(plugin, name))
    }


def test_the_plugin_registers_and_activates(conformance):
    assert not conformance.load_error, conformance.load_error
    assert conformance.active is not None


def test_discovered_under_its_name(conformance):
    name = conformance.source.name
    if conformance.source.spec is not None:
        assert conformance.plugin is not None, f"in-process plugin {conformance.source.spec!r}"
        return
    entry_points = metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
    names = [ep.name for ep in entry_points]
    assert names.count(name) == 1, (
        f"entry point group {hookspecs.ENTRY_POINT_GROUP!r} has {names}; expected {name!r} once"
    )
    assert conformance.plugin is not None


def test_api_version_is_compatible(conformance):
    version = conformance.plugin.tokenmill_api_version()
    major, minor = (int(p) for p in version.split("."))
    core_major, core_minor = (int(p) for p in PLUGIN_API_VERSION.split("."))
    assert major == core_major and minor <= core_minor, (version, PLUGIN_API_VERSION)


def test_required_hooks_are_implemented(conformance):
    missing = hookspecs.REQUIRED_HOOKS - set(_hooks(conformance.plugin))
    assert not missing, f"missing required hooks {sorted(missing)}"


def test_hook_names_and_signatures(conformance):
    for name, function in _hooks(conformance.plugin).items():
        assert name in HOOKSPECS, f"{name} is not a hook; hooks are {sorted(HOOKSPECS)}"
        assert hasattr(function, f"{hookspecs.PROJECT_NAME}_impl"), f"{name} lacks @hookimpl"
        accepted = set(inspect.signature(function).parameters)
        offered = set(inspect.signature(HOOKSPECS[name]).parameters)
        assert accepted <= offered, f"{name} takes {sorted(accepted - offered)} the hook lacks"


def test_detect_is_cheap_and_says_why(conformance):
    start = time.perf_counter()
    result = conformance.plugin.tokenmill_detect()
    elapsed = time.perf_counter() - start
    assert isinstance(result, DetectionResult), result
    assert result.available, f"the platform is not available here: {result.reason}"
    assert isinstance(result.reason, str) and result.reason, "give a reason, shown to users"
    assert elapsed < 5.0, f"tokenmill_detect took {elapsed:.1f} s; it must be a cheap probe"


def test_platform_is_valid_and_idempotent(conformance, active):
    platform = active.platform
    assert isinstance(platform, Platform)
    caps = platform.capabilities
    assert isinstance(caps, Capabilities)
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.collectives = not caps.collectives  # type: ignore[misc]
    assert all(isinstance(k, AttentionKind) for k in caps.attention_kinds)
    assert all(isinstance(d, torch.dtype) for d in caps.dtypes)
    assert all(isinstance(s, int) and s > 0 for s in caps.head_sizes)
    assert platform.default_dtype in caps.dtypes
    torch.empty(1, device=platform.device)  # the device type is one torch knows
    info = platform.memory_info()
    assert isinstance(info, MemoryInfo) and info.total_bytes >= info.free_bytes >= 0
    again = call_hook(conformance.plugin, "tokenmill_platform")
    assert again.name == platform.name and again.capabilities == caps, "not idempotent"


def test_attention_backends_cover_the_declared_kinds(active):
    backends = active.attention_backends
    assert backends and all(isinstance(b, AttentionBackend) for b in backends)
    caps = active.platform.capabilities
    assert {b.kind for b in backends} == set(caps.attention_kinds)
    assert all(isinstance(b.name, str) and b.name for b in backends)
    for dtype in caps.dtypes:
        for kind in caps.attention_kinds:
            if kind is AttentionKind.LINEAR:
                continue  # specs need a variant's state: t1/test_linear_attention.py
            window = 8 if kind is AttentionKind.SLIDING_WINDOW else None
            head = min(caps.head_sizes)
            block = min(caps.block_sizes)
            if kind is AttentionKind.MLA:  # one latent row per token (MLADims)
                dims = MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                               v_head_dim=16)
                spec = AttentionSpec(kind, 4, 1, dims.latent_size, dtype, block, mla=dims)
            else:
                spec = AttentionSpec(kind, 4, 2, head, dtype, block, sliding_window=window)
            assert any(b.kind == kind and b.supports(spec) for b in backends), (
                f"no backend supports {spec}, though {dtype} and {kind} are declared"
            )


@pytest.mark.parametrize("purpose", list(AllocatorPurpose), ids=lambda p: p.value)
def test_allocator_for_each_purpose(active, purpose):
    allocator = active.allocator(purpose)
    assert isinstance(allocator, Allocator) and allocator.purpose == purpose
    assert allocator.bytes_limit() > 0 and allocator.bytes_in_use() >= 0


def test_hardware_spec(active):
    spec = active.hardware_spec()
    assert isinstance(spec, HardwareSpec) and spec.name
    for dtype in sorted(active.platform.capabilities.dtypes, key=str):
        name = str(dtype).removeprefix("torch.")
        peak = spec.peak_flops.get(name)
        assert peak is not None, (
            f"HardwareSpec.peak_flops has no peak for the declared dtype {name!r} (it has "
            f"{sorted(spec.peak_flops)}): the planner and T5 need one for every dtype")
        assert peak > 0, f"HardwareSpec.peak_flops[{name!r}] = {peak!r} must be positive"
    assert spec.memory_bandwidth > 0 and spec.memory_bytes > 0 and spec.link_bandwidth >= 0


def test_op_overrides_are_known_and_callable(conformance, active):
    hook = getattr(conformance.plugin, "tokenmill_ops", None)
    if hook is None:
        pytest.skip("tokenmill_ops is not implemented: the core's reference ops are used")
    overrides = call_hook(conformance.plugin, "tokenmill_ops", platform=active.platform) or {}
    assert isinstance(overrides, dict)
    assert set(overrides) <= OP_NAMES, sorted(set(overrides) - OP_NAMES)
    assert all(callable(fn) for fn in overrides.values())


def test_communicator_when_collectives_are_declared(conformance, active):
    if not active.platform.capabilities.collectives:
        assert active.platform.capabilities.collectives is False
        return
    assert hasattr(conformance.plugin, "tokenmill_communicator")
    # In a single process without torch.distributed the world is this process.
    comm = active.communicator()
    assert isinstance(comm, Communicator) and comm.world_size >= 1


def test_waivers_are_well_formed(active):
    waivers = active.waivers()
    assert all(isinstance(w, tuple) and len(w) == 2 for w in waivers)
