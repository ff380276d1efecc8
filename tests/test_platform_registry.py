"""The platform registry: discovery, validation, selection, and the ActivePlatform handle."""

from __future__ import annotations

from importlib import metadata

import pluggy
import pytest
import torch

from tokenmill.platforms import registry as registry_module
from tokenmill.platforms.interfaces import (
    Allocator,
    AllocatorPurpose,
    AttentionBackend,
    AttentionKind,
    AttentionSpec,
    Capabilities,
    DetectionResult,
    HardwareSpec,
    MemoryInfo,
    Platform,
)
from tokenmill.platforms.registry import (
    ActivePlatform,
    PlatformError,
    PlatformRegistry,
    list_platforms,
    load_platform,
    register_plugin,
)
from tokenmill.platforms.versions import PLUGIN_API_VERSION

hookimpl = pluggy.HookimplMarker("tokenmill")


class FakeBackend(AttentionBackend):
    name = "fake"
    kind = AttentionKind.FULL

    def supports(self, spec: AttentionSpec) -> bool:
        return spec.head_size == 64

    def forward(self, spec, query, key, value, kv_cache, metadata):
        raise NotImplementedError


class FakeAllocator(Allocator):
    def __init__(self, purpose: AllocatorPurpose) -> None:
        self.purpose = purpose

    def allocate(self, num_bytes):
        return torch.empty(num_bytes, dtype=torch.uint8)

    def free(self, buffer):
        return None

    def bytes_in_use(self):
        return 0

    def bytes_limit(self):
        return 1 << 20


class FakePlugin:
    """A minimal valid plugin; subclasses break one thing each."""

    def __init__(self, name: str = "fake", available: bool = True,
                 api: str = PLUGIN_API_VERSION) -> None:
        self.label = name
        self.available = available
        self.api = api

    @hookimpl
    def tokenmill_api_version(self):
        return self.api

    @hookimpl
    def tokenmill_detect(self):
        return DetectionResult(self.available, f"{self.label} probe says {self.available}")

    @hookimpl
    def tokenmill_platform(self):
        return Platform(
            name=self.label,
            device_type="cpu",
            capabilities=Capabilities(),
            default_dtype=torch.float32,
            memory_info=lambda: MemoryInfo(1, 1),
        )

    @hookimpl
    def tokenmill_attention_backends(self, platform):
        return [FakeBackend()]

    @hookimpl
    def tokenmill_allocator(self, platform, purpose):
        return FakeAllocator(purpose)

    @hookimpl
    def tokenmill_hardware_spec(self, platform):
        return HardwareSpec(self.label, {"float32": 1e12}, memory_bandwidth=1e11, memory_bytes=1)


def registry_with(*plugins: FakePlugin) -> PlatformRegistry:
    registry = PlatformRegistry()
    for plugin in plugins:
        registry.register_plugin(plugin, plugin.label)
    return registry


@pytest.fixture(autouse=True)
def no_platform_env(monkeypatch):
    monkeypatch.delenv(registry_module.PLATFORM_ENV, raising=False)


# -- discovery of the installed CPU plugin ----------------------------------------------


def test_installed_cpu_plugin_is_discovered_through_its_entry_point():
    infos = {info.name: info for info in list_platforms()}
    cpu = infos["cpu"]
    assert cpu.distribution == "tokenmill-cpu"
    assert cpu.version == metadata.version("tokenmill-cpu")
    assert cpu.available and cpu.reason
    assert AttentionKind.SLIDING_WINDOW in cpu.capabilities.attention_kinds


def test_load_platform_picks_the_only_available_plugin():
    active = load_platform()
    assert isinstance(active, ActivePlatform)
    assert active.name == "cpu" and active.platform.device_type == "cpu"
    assert active.version == metadata.version("tokenmill-cpu")


def test_env_var_selects_and_unknown_env_name_lists_known(monkeypatch):
    monkeypatch.setenv("TOKENMILL_PLATFORM", "cpu")
    assert load_platform().name == "cpu"
    monkeypatch.setenv("TOKENMILL_PLATFORM", "quantum")
    with pytest.raises(PlatformError, match=r"'quantum' \(from \$TOKENMILL_PLATFORM\).*cpu"):
        load_platform()


def test_explicit_name_beats_env(monkeypatch):
    monkeypatch.setenv("TOKENMILL_PLATFORM", "quantum")
    assert load_platform("cpu").name == "cpu"


# -- selection rules ---------------------------------------------------------------------


def test_no_plugin_installed_says_how_to_install_one():
    with pytest.raises(PlatformError, match=r"pip install plugins/cpu.*tokenmill-cpu"):
        PlatformRegistry().load_platform()


def test_unknown_name_lists_the_known_ones():
    registry = registry_with(FakePlugin("alpha"), FakePlugin("beta"))
    with pytest.raises(PlatformError, match=r"unknown platform 'gamma'.*alpha, beta"):
        registry.load_platform("gamma")


def test_several_available_without_a_choice_is_an_error_listing_them():
    registry = registry_with(FakePlugin("alpha"), FakePlugin("beta"))
    with pytest.raises(PlatformError, match=r"several.*TOKENMILL_PLATFORM.*\['alpha', 'beta'\]"):
        registry.load_platform()


def test_only_the_available_one_is_chosen_and_explicit_unavailable_fails_with_reason():
    registry = registry_with(FakePlugin("alpha", available=False), FakePlugin("beta"))
    assert registry.load_platform().name == "beta"
    with pytest.raises(PlatformError, match="'alpha' is not available: alpha probe says False"):
        registry.load_platform("alpha")


def test_none_available_lists_reasons():
    registry = registry_with(FakePlugin("alpha", available=False))
    with pytest.raises(PlatformError, match="no platform is available.*alpha probe says False"):
        registry.load_platform()


def test_hooks_of_one_plugin_never_mix_with_another():
    class WithOps(FakePlugin):
        @hookimpl
        def tokenmill_ops(self, platform):
            return {"rms_norm": lambda x, weight, eps: x}

    registry = registry_with(WithOps("alpha"), FakePlugin("beta"))
    beta = registry.load_platform("beta")
    assert beta.hardware_spec().name == "beta"
    assert beta.platform.name == "beta"
    assert beta.ops.rms_norm.__module__ == "tokenmill.platforms.ops.reference"
    alpha = registry.load_platform("alpha")
    assert alpha.hardware_spec().name == "alpha"
    assert alpha.ops.rms_norm.__module__ == __name__


def test_register_plugin_function_and_duplicate_names():
    registry = register_plugin(FakePlugin("alpha"), "alpha", PlatformRegistry())
    assert registry.names == ["alpha"]
    with pytest.raises(PlatformError, match="two platform plugins are named 'alpha'"):
        registry.register_plugin(FakePlugin("alpha"), "alpha")


def test_broken_entry_point_is_listed_and_blocks_only_automatic_choice(monkeypatch):
    real = metadata.entry_points(group="tokenmill.platforms")
    broken = metadata.EntryPoint("broken", "tokenmill_no_such_module", "tokenmill.platforms")
    monkeypatch.setattr(metadata, "entry_points", lambda group: [*real, broken])
    infos = {info.name: info for info in list_platforms()}
    assert not infos["broken"].available
    assert "cannot import 'tokenmill_no_such_module'" in infos["broken"].reason
    with pytest.raises(PlatformError, match="several.*broken: cannot import"):
        load_platform()
    assert load_platform("cpu").name == "cpu"
    with pytest.raises(PlatformError, match="'broken' is broken"):
        load_platform("broken")


def test_entry_point_failing_with_any_error_is_reported_not_raised(monkeypatch):
    real = metadata.entry_points(group="tokenmill.platforms")
    missing_attr = metadata.EntryPoint(
        "odd", "tokenmill.platforms.hookspecs:no_such_plugin", "tokenmill.platforms"
    )
    monkeypatch.setattr(metadata, "entry_points", lambda group: [*real, missing_attr])
    infos = {info.name: info for info in list_platforms()}
    assert not infos["odd"].available and "AttributeError" in infos["odd"].reason


def test_a_probe_that_raises_is_reported_and_blocks_only_automatic_choice():
    class Crashing(FakePlugin):
        @hookimpl
        def tokenmill_detect(self):
            raise OSError("driver went away")

    registry = registry_with(Crashing("alpha"), FakePlugin("beta"))
    infos = {info.name: info for info in registry.list_platforms()}
    assert not infos["alpha"].available
    assert "'alpha': tokenmill_detect raised OSError('driver went away')" in infos["alpha"].reason
    with pytest.raises(PlatformError, match="several.*alpha: platform plugin 'alpha'"):
        registry.load_platform()
    assert registry.load_platform("beta").name == "beta"
    with pytest.raises(PlatformError, match="'alpha': tokenmill_detect raised") as caught:
        registry.load_platform("alpha")
    assert isinstance(caught.value.__cause__, OSError)


# -- validation at registration ----------------------------------------------------------


@pytest.mark.parametrize("api", ["2.0", "1.99", "0.9", "one", "1", 1.0])
def test_incompatible_or_malformed_api_version_is_rejected(api):
    with pytest.raises(PlatformError, match=r"plugin 'alpha'.*API version|plugin 'alpha' targets"):
        registry_with(FakePlugin("alpha", api=api))


def test_older_minor_api_version_is_accepted():
    registry_with(FakePlugin("alpha", api="1.0"))


def test_unknown_hook_is_rejected_with_the_plugin_name():
    class Typo(FakePlugin):
        @hookimpl
        def tokenmill_platfrom(self):
            return None

    with pytest.raises(PlatformError, match="'alpha' defines unknown hook 'tokenmill_platfrom'"):
        registry_with(Typo("alpha"))


def test_unmarked_hook_is_rejected():
    class Unmarked(FakePlugin):
        def tokenmill_waivers(self, platform):
            return []

    with pytest.raises(PlatformError, match="'alpha' defines 'tokenmill_waivers' without"):
        registry_with(Unmarked("alpha"))


def test_bad_hook_signature_is_rejected():
    class ExtraArgument(FakePlugin):
        @hookimpl
        def tokenmill_ops(self, platform, device):
            return {}

    with pytest.raises(PlatformError, match="(?s)'alpha' is invalid.*'device'"):
        registry_with(ExtraArgument("alpha"))


def test_missing_required_hook_is_rejected():
    class NoSpec(FakePlugin):
        tokenmill_hardware_spec = None

    with pytest.raises(PlatformError, match=r"'alpha' does not implement.*tokenmill_hardware_spec"):
        registry_with(NoSpec("alpha"))


def test_rejected_plugin_leaves_the_registry_usable():
    registry = PlatformRegistry()
    with pytest.raises(PlatformError):
        registry.register_plugin(FakePlugin("alpha", api="9.0"), "alpha")
    registry.register_plugin(FakePlugin("beta"), "beta")
    assert registry.load_platform().name == "beta"


# -- validation of returned objects ------------------------------------------------------


class NotAPlatform(FakePlugin):
    @hookimpl
    def tokenmill_platform(self):
        return {"name": "alpha"}


class DtypeNotDeclared(FakePlugin):
    @hookimpl
    def tokenmill_platform(self):
        return Platform("alpha", "cpu", Capabilities(), torch.bfloat16, lambda: MemoryInfo(1, 1))


class BackendNotABackend(FakePlugin):
    @hookimpl
    def tokenmill_attention_backends(self, platform):
        return [object()]


class UndeclaredKind(FakePlugin):
    @hookimpl
    def tokenmill_attention_backends(self, platform):
        sliding = FakeBackend()
        sliding.kind = AttentionKind.SLIDING_WINDOW
        return [FakeBackend(), sliding]


class UnknownOp(FakePlugin):
    @hookimpl
    def tokenmill_ops(self, platform):
        return {"flash_rms_norm": lambda x: x}


@pytest.mark.parametrize(
    "plugin_class, message",
    [
        (NotAPlatform, "tokenmill_platform returned .*expected Platform"),
        (DtypeNotDeclared, r"bad Platform.*default_dtype=torch.bfloat16 is not in"),
        (BackendNotABackend, "tokenmill_attention_backends returned .*expected AttentionBackend"),
        (UndeclaredKind, "backends cover attention kinds"),
        (UnknownOp, r"overrides unknown ops \['flash_rms_norm'\]"),
    ],
)
def test_bad_return_values_fail_at_activation_naming_the_plugin(plugin_class, message):
    registry = registry_with(plugin_class("alpha"))
    with pytest.raises(PlatformError, match=f"plugin 'alpha'.*{message}"):
        registry.load_platform("alpha")


def test_declared_collectives_need_a_communicator():
    class Collective(FakePlugin):
        @hookimpl
        def tokenmill_platform(self):
            caps = Capabilities(collectives=True)
            return Platform("alpha", "cpu", caps, torch.float32, lambda: MemoryInfo(1, 1))

    with pytest.raises(PlatformError, match="declares collectives but does not implement"):
        registry_with(Collective("alpha")).load_platform()


def test_bad_allocator_hardware_spec_and_waivers_fail_when_asked():
    class Bad(FakePlugin):
        @hookimpl
        def tokenmill_allocator(self, platform, purpose):
            return FakeAllocator(AllocatorPurpose.WEIGHTS)

        @hookimpl
        def tokenmill_hardware_spec(self, platform):
            return HardwareSpec("x", {"bfloat16": 1e12}, memory_bandwidth=0.0, memory_bytes=1)

        @hookimpl
        def tokenmill_waivers(self, platform):
            return [("t1::test_x", "")]

    active = registry_with(Bad("alpha")).load_platform()
    with pytest.raises(PlatformError, match="asked for a kv_arena allocator"):
        active.allocator(AllocatorPurpose.KV_ARENA)
    with pytest.raises(PlatformError, match=r"bad HardwareSpec.*memory_bandwidth.*'float32'"):
        active.hardware_spec()
    with pytest.raises(PlatformError, match="tokenmill_waivers returned"):
        active.waivers()
    with pytest.raises(PlatformError, match="does not implement tokenmill_communicator"):
        active.communicator()


# -- the ActivePlatform handle -----------------------------------------------------------


def test_attention_backend_selection_and_error_naming_the_spec():
    active = registry_with(FakePlugin("alpha")).load_platform()
    spec = AttentionSpec(AttentionKind.FULL, 8, 2, 64, torch.float32, 16)
    assert isinstance(active.attention_backend(spec), FakeBackend)
    bad = AttentionSpec(AttentionKind.FULL, 8, 2, 80, torch.float32, 16)
    with pytest.raises(PlatformError, match="'alpha' has no attention backend for .*head_size=80"):
        active.attention_backend(bad)


def test_allocators_are_kept_per_purpose_and_defaults_for_optional_hooks():
    active = registry_with(FakePlugin("alpha")).load_platform()
    kv = active.allocator(AllocatorPurpose.KV_ARENA)
    assert active.allocator(AllocatorPurpose.KV_ARENA) is kv
    assert active.allocator(AllocatorPurpose.WEIGHTS) is not kv
    assert active.waivers() == []
    assert active.graph_capture(8) is None


def _context():
    from tokenmill.platforms.interfaces import KVCacheSpec, ModelRunnerContext, ParallelConfig

    return ModelRunnerContext(
        hf_config=None, model_path="/nowhere", weights=lambda: iter(()), dtype=torch.float32,
        device=torch.device("cpu"), kv_cache=KVCacheSpec((), 16), parallel=ParallelConfig(),
        max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128, seed=0,
    )


class RunnerIsNotARunner(FakePlugin):
    @hookimpl
    def tokenmill_model_runner(self, platform, context):
        return object()


def _runner(caps, layout):
    from tokenmill.platforms.interfaces import ModelRunnerBase

    class Runner(ModelRunnerBase):
        def capabilities(self):
            return caps

        def kv_cache_layout(self):
            return layout

        def bind_kv_cache(self, pages):
            pass

        def execute(self, step):
            raise NotImplementedError

    return Runner()


SPEC = AttentionSpec(AttentionKind.FULL, 4, 4, 64, torch.float32, 16)


class RunnerWithoutKinds(FakePlugin):
    @hookimpl
    def tokenmill_model_runner(self, platform, context):
        from tokenmill.platforms.interfaces import KVCacheLayout, RunnerCapabilities

        return _runner(RunnerCapabilities(frozenset()), KVCacheLayout((SPEC,)))


class RunnerWithBadLayout(FakePlugin):
    @hookimpl
    def tokenmill_model_runner(self, platform, context):
        from tokenmill.platforms.interfaces import KVCacheLayout, RunnerCapabilities

        caps = RunnerCapabilities(frozenset({AttentionKind.FULL}))
        return _runner(caps, KVCacheLayout((SPEC,), layer_slots=(0, 1)))


class FallbackRunners:
    """A model_runner plugin: what the core's runner plugin is to every platform."""

    @hookimpl
    def tokenmill_api_version(self):
        return PLUGIN_API_VERSION

    @hookimpl
    def tokenmill_model_runner(self, platform, context):
        from tokenmill.platforms.interfaces import KVCacheLayout, RunnerCapabilities

        return _runner(RunnerCapabilities(frozenset({AttentionKind.FULL})), KVCacheLayout((SPEC,)))


def test_a_platform_without_a_runner_gets_the_model_runner_plugins_one():
    from tokenmill.platforms.plugins import MODEL_RUNNER, PluginManager

    plugins = PluginManager()
    plugins.register(FallbackRunners(), MODEL_RUNNER, "fallback")
    registry = PlatformRegistry(plugins)
    registry.register_plugin(FakePlugin("alpha"), "alpha")
    runner, provider = registry.load_platform("alpha").model_runner(_context())
    assert provider == "fallback" and runner.capabilities().attention_kinds == {AttentionKind.FULL}
    registry.register_plugin(WithOwnRunner("beta"), "beta")
    runner, provider = registry.load_platform("beta").model_runner(_context())
    assert provider == "beta", "the platform's own runner goes first"


class WithOwnRunner(FakePlugin):
    @hookimpl
    def tokenmill_model_runner(self, platform, context):
        return FallbackRunners().tokenmill_model_runner(platform, context)


class GraphsWithoutTheCapability(FakePlugin):
    @hookimpl
    def tokenmill_graph_capture(self, platform):
        raise AssertionError("called although capabilities.graphs is False")


def test_model_runner_and_graph_capture_results_are_validated():
    context = _context()
    active = registry_with(RunnerIsNotARunner("bad")).load_platform()
    with pytest.raises(PlatformError, match="'bad': tokenmill_model_runner returned .*ModelRunnerBase"):
        active.model_runner(context)
    active = registry_with(RunnerWithoutKinds("nokinds")).load_platform()
    with pytest.raises(PlatformError, match=r"'nokinds': Runner.capabilities\(\) returned .*"
                                            "expected a RunnerCapabilities naming"):
        active.model_runner(context)
    active = registry_with(RunnerWithBadLayout("slots")).load_platform()
    with pytest.raises(PlatformError, match="'slots': Runner.kv_cache_layout.*2 layer slots for 1"):
        active.model_runner(context)
    active = registry_with(GraphsWithoutTheCapability("nographs")).load_platform()
    assert active.graph_capture(8) is None


# -- devices asked for by name (the planner) ------------------------------------------


class TablePlugin(FakePlugin):
    """A plugin whose hardware table holds one part, "X1"."""

    @hookimpl
    def tokenmill_hardware_spec(self, platform, device):
        if device is None:
            return HardwareSpec(self.label, {"float32": 1e12}, 1e11, 1)
        if device.lower() != "x1":
            return None
        return HardwareSpec("X1", {"bfloat16": 4e14}, 2e12, 96 << 30, 2e11)


def test_device_spec_asks_only_plugins_with_a_table_even_unavailable_ones():
    registry = registry_with(FakePlugin("alpha"), TablePlugin("beta", available=False))
    name, spec = registry.device_spec("x1")
    assert name == "beta" and spec.name == "X1" and spec.link_bandwidth == 2e11
    # the active device's spec still comes through the same hook, device None
    assert registry_with(TablePlugin("gamma")).load_platform().hardware_spec().name == "gamma"
    with pytest.raises(PlatformError, match=r"device 'Z9' \(asked: beta\)"):
        registry.device_spec("Z9")


def test_installed_plugins_tables_hold_the_devices_the_planner_names():
    """The installed GPU and TPU plugins answer from their tables on this CPU machine."""
    found = {d: registry_module.device_spec(d) for d in ("H200", "B200", "MI300X", "TPU v5e")}
    assert {d: n for d, (n, _) in found.items()} == {
        "H200": "nvidia", "B200": "nvidia", "MI300X": "rocm", "TPU v5e": "tpu"}
    h200, b200 = found["H200"][1], found["B200"][1]
    assert h200.memory_bandwidth == 4.8e12 and h200.memory_bytes == 141 << 30
    assert b200.peak_flops["bfloat16"] == 2250e12 and b200.link_bandwidth == 900e9
    assert found["MI300X"][1].memory_bytes == 192 << 30
    assert found["TPU v5e"][1].memory_bytes == 16 << 30
    assert registry_module.device_spec("cpu")[0] == "cpu"
