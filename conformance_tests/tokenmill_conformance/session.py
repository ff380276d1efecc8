"""One certification run: which plugin, loaded how, and what the tests found.

The pytest plugin builds one `Conformance` per run and the suite's fixtures hand it to the
tests. It owns the `PlatformRegistry` holding the plugin under test (from its entry point,
or registered in-process from `--tokenmill-plugin`) next to the core's reference platform.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from tokenmill.platforms import hookspecs
from tokenmill.platforms.registry import ActivePlatform, PlatformRegistry
from tokenmill_conformance import reference_platform

REFERENCE_NAME = "tokenmill-reference"


def import_plugin(spec: str) -> object:
    """A plugin object from 'package.module', 'package.module:attr', 'path/to/file.py' or
    'path/to/file.py:attr' (an object of the module, e.g. a plugin class instance)."""
    if spec.endswith(".py"):
        target, attr = spec, ""
    elif ".py:" in spec:
        target, _, attr = spec.rpartition(":")
    else:
        target, _, attr = spec.partition(":")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"--tokenmill-plugin {spec!r}: no such file {path}")
        name = f"_tokenmill_inprocess_{path.stem}"
        module = sys.modules.get(name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(name, path)
            assert loader_spec is not None and loader_spec.loader is not None
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, attr) if attr else module


@dataclass(slots=True)
class PluginSource:
    """How to find the plugin under test; picklable, so worker processes can load it too."""

    name: str
    spec: str | None = None  # in-process plugin spec; None: the installed entry point

    def registry(self) -> tuple[PlatformRegistry, object | None]:
        """(a registry holding the plugin and the reference platform, the plugin object)."""
        registry = PlatformRegistry.discover() if self.spec is None else PlatformRegistry()
        plugin = None
        if self.spec is not None:
            plugin = import_plugin(self.spec)
            registry.register_plugin(plugin, self.name)
        else:
            for entry_point in metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
                if entry_point.name == self.name:
                    plugin = entry_point.load()
        registry.register_plugin(reference_platform, REFERENCE_NAME)
        return registry, plugin

    def load(self) -> ActivePlatform:
        return self.registry()[0].load_platform(self.name)


@dataclass(slots=True)
class Conformance:
    """The state of one run, shared by the suite's fixtures and the certificate."""

    source: PluginSource
    quick: bool = False
    registry: PlatformRegistry | None = None
    plugin: object | None = None  # the plugin module / object, when it could be imported
    active: ActivePlatform | None = None
    load_error: str = ""  # why the plugin could not be registered or activated
    distribution: str = "<in-process>"
    version: str = "0"
    performance: dict[str, object] = field(default_factory=dict)  # filled by tier T5
    calibration: list[dict] = field(default_factory=list)  # T5's records for the planner
    compile_records: dict[str, object] = field(default_factory=dict)  # by t1/test_kernel_builds

    def load(self) -> None:
        """Register and activate the plugin; a failure is kept for tier T0 to report."""
        try:
            self.registry, self.plugin = self.source.registry()
            info = {i.name: i for i in self.registry.list_platforms()}.get(self.source.name)
            if info is not None:
                self.distribution, self.version = info.distribution, info.version
            self.active = self.registry.load_platform(self.source.name)
        except Exception as exc:  # any failure to load is what tier T0 reports, not a crash
            self.load_error = f"{type(exc).__name__}: {exc}"

    def reference(self) -> ActivePlatform:
        """The core's reference platform: reference attention and ops on the CPU."""
        assert self.registry is not None
        return self.registry.load_platform(REFERENCE_NAME)


def call_hook(plugin: object, hook: str, **kwargs: object) -> object:
    """Call one hook implementation directly, passing only the arguments it accepts."""
    function = getattr(plugin, hook)
    accepted = inspect.signature(function).parameters
    return function(**{k: v for k, v in kwargs.items() if k in accepted})
