"""A declared plugin API version is a floor the registry enforces: a hook, attention kind,
op or field newer than the version a plugin declares is refused, naming the version that
introduced it. The plugins in this repository declare what they use, and the contract's
changelog has an entry for every version the tables name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_platform_registry import FakeBackend, FakePlugin, hookimpl, registry_with

from tokenmill.platforms.interfaces import (
    AttentionKind,
    AttentionSpec,
    Capabilities,
    DetectionResult,
    Platform,
)
from tokenmill.platforms.registry import PlatformError, PlatformRegistry
from tokenmill.platforms.versions import PLUGIN_API_VERSION, all_versions

ROOT = Path(__file__).resolve().parent.parent


def _load(plugin: FakePlugin):
    return registry_with(plugin).load_platform(plugin.label)


class WithRunner(FakePlugin):
    @hookimpl
    def tokenmill_model_runner(self, platform, context):
        return None


class WithKernelBuilds(FakePlugin):
    @hookimpl
    def tokenmill_kernel_builds(self, platform):
        return None


class LinearBackend(FakeBackend):
    kind = AttentionKind.LINEAR


class WithLinear(FakePlugin):
    @hookimpl
    def tokenmill_platform(self):
        platform = super().tokenmill_platform()
        caps = Capabilities(attention_kinds=frozenset({AttentionKind.FULL, AttentionKind.LINEAR}))
        return Platform(platform.name, platform.device_type, caps, platform.default_dtype,
                        platform.memory_info)

    @hookimpl
    def tokenmill_attention_backends(self, platform):
        return [FakeBackend(), LinearBackend()]


class WithMoeOp(FakePlugin):
    @hookimpl
    def tokenmill_ops(self, platform):
        return {"moe_experts": lambda *args: None}


class WithSleepMode(FakePlugin):
    @hookimpl
    def tokenmill_platform(self):
        platform = super().tokenmill_platform()
        return Platform(platform.name, platform.device_type, Capabilities(sleep_mode=True),
                        platform.default_dtype, platform.memory_info)


class OwnLayout(FakeBackend):
    def kv_cache_shape(self, spec: AttentionSpec, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, spec.block_size, 2 * spec.num_kv_heads, spec.head_size)


class WithOwnLayout(FakePlugin):
    @hookimpl
    def tokenmill_attention_backends(self, platform):
        return [OwnLayout()]


@pytest.mark.parametrize("plugin_cls,declared,what,since", [
    (WithRunner, "1.5", "hook tokenmill_model_runner", "1.6"),
    (WithKernelBuilds, "1.4", "hook tokenmill_kernel_builds", "1.5"),
    (WithLinear, "1.2", "attention kind linear", "1.3"),
    (WithMoeOp, "1.1", "op moe_experts", "1.2"),
    (WithSleepMode, "1.2", "Capabilities.sleep_mode", "1.3"),
    (WithOwnLayout, "1.2", "AttentionBackend.kv_cache_shape", "1.3"),
])
def test_a_part_newer_than_the_declared_version_is_refused_naming_its_version(
    plugin_cls, declared, what, since
):
    message = (f"'alpha' declares plugin API {declared} but uses {what}, introduced in "
               f"{since}; declare {since} or newer")
    with pytest.raises(PlatformError, match=re.escape(message)):
        _load(plugin_cls("alpha", api=declared))
    _load(plugin_cls("alpha", api=since))  # the version that introduced it is enough


def test_the_plugins_here_declare_exactly_what_they_use(monkeypatch):
    """cpu, nvidia and rocm (in Triton's interpreter) declare the oldest version that has
    every part they use (hooks and their arguments, kinds, ops, fields): no older (the registry would refuse them), no newer (a false floor)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    registry = PlatformRegistry.discover()
    for name in ("cpu", "nvidia", "rocm"):
        active = registry.load_platform(name)
        assert active.api_version == active.required_api_version(), name


def test_an_argument_newer_than_the_declared_version_is_refused():
    class WithDeviceTable(FakePlugin):
        @hookimpl
        def tokenmill_hardware_spec(self, platform, device):
            return super().tokenmill_hardware_spec(platform)

    with pytest.raises(PlatformError, match=r"declares plugin API 1.3 but uses argument "
                                            r"'device' of tokenmill_hardware_spec, introduced in 1.4"):
        _load(WithDeviceTable("alpha", api="1.3"))
    assert _load(WithDeviceTable("alpha", api="1.4")).required_api_version() == "1.4"
    assert _load(FakePlugin("alpha", api="1.0")).required_api_version() == "1.0"


def test_the_skeleton_declares_the_current_version_and_is_unavailable_by_default(
    tmp_path, monkeypatch
):
    from tokenmill.platforms.template import write_plugin

    root = write_plugin("skel", tmp_path)
    monkeypatch.syspath_prepend(str(root))
    from tokenmill_skel import plugin

    assert plugin.tokenmill_api_version() == PLUGIN_API_VERSION
    monkeypatch.delenv("TOKENMILL_SKEL_AVAILABLE", raising=False)
    found = plugin.tokenmill_detect()
    assert isinstance(found, DetectionResult) and not found.available
    assert "TOKENMILL_SKEL_AVAILABLE=1" in found.reason
    monkeypatch.setenv("TOKENMILL_SKEL_AVAILABLE", "1")
    assert plugin.tokenmill_detect().available
    registry = PlatformRegistry()
    registry.register_plugin(plugin, "skel")
    assert registry.load_platform("skel").platform.default_dtype == torch.float32


def test_the_changelog_has_every_version():
    text = (ROOT / "docs" / "contract-changelog.md").read_text()
    headings = set(re.findall(r"^## (\d+\.\d+)\b", text, flags=re.MULTILINE))
    assert all_versions() <= headings, sorted(all_versions() - headings)
    assert f"## {PLUGIN_API_VERSION}" in text
