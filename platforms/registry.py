"""Find, validate, select and activate platform plugins.

Platform plugins are the `platform` kind of the one plugin manager
(`tokenmill.platforms.plugins.PluginManager`): discovered through the entry point group
`tokenmill.platforms`, validated there (hook names, signatures, required hooks, API
version) and called one at a time, so several installed plugins never mix. Activation
checks what the plugin returns, including that nothing it declares is newer than its
declared API version (`tokenmill.platforms.platform_checks`).

Selection (`load_platform`): an explicit name, else `$TOKENMILL_PLATFORM`, else the one
available plugin. The result is an `ActivePlatform`, the core's only handle on a plugin.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.platforms.interfaces import (
    Allocator,
    AllocatorPurpose,
    AttentionBackend,
    AttentionSpec,
    Capabilities,
    Communicator,
    DetectionResult,
    GraphCapture,
    HardwareSpec,
    KernelBuild,
    ModelRunnerBase,
    ModelRunnerContext,
    Platform,
)
from tokenmill.platforms.ops import Ops, resolve_ops
from tokenmill.platforms.platform_checks import (
    PlatformError,
    check_allocator,
    check_backends,
    check_hardware_spec,
    check_ops,
    check_platform,
    check_runner,
    check_type,
    check_versions,
    check_waivers,
    versioned_parts,
)
from tokenmill.platforms.plugins import (
    CORE_PLUGIN_NAME,
    IN_PROCESS,
    MODEL_RUNNER,
    PLATFORM,
    PluginError,
    PluginManager,
)
from tokenmill.platforms.versions import parse_version

logger = logging.getLogger(__name__)

PLATFORM_ENV = "TOKENMILL_PLATFORM"
_INSTALL_HINT = "install one, e.g. `pip install plugins/cpu` (distribution tokenmill-cpu)"


@dataclass(frozen=True, slots=True)
class PlatformInfo:
    """One installed plugin, as `list_platforms()` and `tokenmill platforms` show it."""

    name: str  # entry point name, what `--platform` takes
    distribution: str  # the distribution that installed it, or "<in-process>"
    version: str  # that distribution's version
    available: bool
    reason: str  # why (not) available, from the probe, or the load error
    capabilities: Capabilities | None = None  # only when available
    api_version: str | None = None  # the plugin API version it declares


class ActivePlatform:
    """The activated plugin: the one object the engine asks for backends, ops and memory.

    Built by `load_platform`; validates what the plugin returns and fails naming it.
    Allocators are created once per purpose and kept, so their accounting is global.
    """

    def __init__(
        self, name: str, version: str, call: Callable[..., object], implemented: frozenset[str],
        api_version: str, plugins: PluginManager | None = None,
        hook_parts: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """`plugins`: the manager holding the model_runner plugins (the core's runner);
        `hook_parts`: (hook or argument, its version) of what the plugin implements."""
        self.name = name
        self._plugins = plugins
        self._hook_parts = hook_parts
        self.version = version
        self.api_version = api_version  # the plugin API version the plugin declares
        self._call = call
        self.platform: Platform = check_platform(name, call("tokenmill_platform"))
        if self.platform.capabilities.collectives and "tokenmill_communicator" not in implemented:
            raise PlatformError(
                f"platform plugin {name!r} declares collectives but does not implement "
                "tokenmill_communicator; implement it or declare collectives=False"
            )
        self._backends = check_backends(
            name, self.platform, call("tokenmill_attention_backends", platform=self.platform)
        )
        overrides = check_ops(name, call("tokenmill_ops", platform=self.platform))
        self._parts = versioned_parts(self.platform, self._backends, overrides)
        check_versions(name, api_version, self._parts)
        self._ops = resolve_ops(overrides, source=f"platform plugin {name!r}")
        self._allocators: dict[AllocatorPurpose, Allocator] = {}

    def __repr__(self) -> str:
        return (
            f"ActivePlatform(name={self.name!r}, version={self.version!r}, "
            f"device={self.platform.device_type!r}, default_dtype={self.platform.default_dtype}, "
            f"backends={[b.name for b in self._backends]})"
        )

    @property
    def attention_backends(self) -> list[AttentionBackend]:
        """All backends, in the plugin's order of preference."""
        return list(self._backends)

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend:
        """The first declared backend whose kind matches and which supports `spec`."""
        for backend in self._backends:
            if backend.kind == spec.kind and backend.supports(spec):
                return backend
        raise PlatformError(
            f"platform {self.name!r} has no attention backend for {spec}; its backends are "
            f"{[(b.name, b.kind.value) for b in self._backends]} and it declares "
            f"{self.platform.capabilities}. Change the model dtype/block size or the platform."
        )

    @property
    def ops(self) -> Ops:
        """The core's reference ops with this plugin's overrides applied."""
        return self._ops

    def allocator(self, purpose: AllocatorPurpose) -> Allocator:
        """The plugin's allocator for `purpose`, created on first use and then kept."""
        if purpose not in self._allocators:
            allocator = self._call("tokenmill_allocator", platform=self.platform, purpose=purpose)
            self._allocators[purpose] = check_allocator(self.name, purpose, allocator)
        return self._allocators[purpose]

    def communicator(self, group: object | None = None) -> Communicator:
        """Collectives over `group` (a torch.distributed ProcessGroup; None for the world)."""
        result = self._call("tokenmill_communicator", platform=self.platform, group=group)
        if result is None:
            raise PlatformError(
                f"platform plugin {self.name!r} does not implement tokenmill_communicator; "
                "it cannot run with tensor/pipeline/expert parallelism"
            )
        return check_type(self.name, "tokenmill_communicator", result, Communicator)

    def hardware_spec(self) -> HardwareSpec:
        """Peak FLOP/s, memory bandwidth and size, as the plugin declares them."""
        spec = self._call("tokenmill_hardware_spec", platform=self.platform, device=None)
        dtype_name = str(self.platform.default_dtype).removeprefix("torch.")
        return check_hardware_spec(self.name, dtype_name, spec)

    def graph_capture(self, max_num_seqs: int) -> GraphCapture | None:
        """The plugin's decode-step graphs, or None to run eagerly (always None when the
        platform does not declare `capabilities.graphs`)."""
        if not self.platform.capabilities.graphs:
            return None
        result = self._call("tokenmill_graph_capture", platform=self.platform)
        if result is None:
            return None
        graphs = check_type(self.name, "tokenmill_graph_capture", result, GraphCapture)
        sizes = graphs.batch_sizes(max_num_seqs)
        if (not isinstance(sizes, list) or not sizes
                or any(not isinstance(n, int) or not 0 < n <= max_num_seqs for n in sizes)
                or sizes != sorted(set(sizes))):
            raise PlatformError(
                f"platform plugin {self.name!r}: GraphCapture.batch_sizes({max_num_seqs}) "
                f"returned {sizes!r}; expected ascending distinct ints in [1, {max_num_seqs}]"
            )
        return graphs

    def model_runner(self, context: ModelRunnerContext) -> tuple[ModelRunnerBase, str]:
        """(the runner for `context`, the name of the plugin that built it): the active
        platform's own if its `tokenmill_model_runner` returns one, else the first
        model_runner plugin's that does, the core's last. Each is checked the same way."""
        candidates = [(self.name, f"platform plugin {self.name!r}", self._call)]
        if self._plugins is not None:
            records = sorted(self._plugins.records(MODEL_RUNNER),
                             key=lambda r: (r.name == CORE_PLUGIN_NAME, r.name))
            candidates += [(r.name, f"model_runner plugin {r.name!r}",
                            self._plugins.caller(MODEL_RUNNER, r.name))
                           for r in records if r.plugin is not None]
        for provider, where, call in candidates:
            try:
                result = call("tokenmill_model_runner", platform=self.platform, context=context)
            except PluginError as exc:
                raise PlatformError(str(exc)) from exc.__cause__
            if result is not None:
                return check_runner(where, result), provider
        raise PlatformError(
            f"no model runner for {context.hf_config.model_type!r} on platform {self.name!r}: "
            "neither the platform plugin nor a model_runner plugin (the core's is "
            f"{CORE_PLUGIN_NAME!r}, entry point group {MODEL_RUNNER.entry_point_group!r}) "
            "returned one; is tokenmill installed (pip install -e .)?"
        )

    def required_api_version(self) -> str:
        """The oldest plugin API version that has every hook, hook argument, attention kind,
        op and field this plugin uses: what it should declare."""
        parts = list(self._hook_parts) + list(self._parts)
        return max((since for _, since in parts), key=parse_version, default="1.0")

    def kernel_builds(self) -> list[KernelBuild] | None:
        """The plugin's kernels compiled for its real targets, or None when it has none."""
        result = self._call("tokenmill_kernel_builds", platform=self.platform)
        if result is None:
            return None
        if not isinstance(result, list) or not all(isinstance(b, KernelBuild) for b in result):
            raise PlatformError(
                f"platform plugin {self.name!r}: tokenmill_kernel_builds returned "
                f"{type(result).__name__}; expected a list of KernelBuild or None"
            )
        return result

    def waivers(self) -> list[tuple[str, str]]:
        """(conformance test id, reason) pairs the plugin asks to waive."""
        result = self._call("tokenmill_waivers", platform=self.platform)
        return check_waivers(self.name, [] if result is None else result)


class PlatformRegistry:
    """The platform plugins of a `PluginManager` (which holds the other kinds too).

    `PlatformRegistry.discover()` loads every entry point of every kind;
    `PlatformRegistry()` starts empty (for tests and in-process plugins, added with
    `register_plugin`).
    """

    def __init__(self, plugins: PluginManager | None = None) -> None:
        """`plugins`: a manager to use; None: one with no platform plugin (they are
        registered with `register_plugin`) but the installed model runners (the core's)."""
        self.plugins = plugins if plugins is not None else PluginManager.discover([MODEL_RUNNER])

    @classmethod
    def discover(cls) -> PlatformRegistry:
        """A registry over every installed plugin (`PluginManager.discover()`).

        A plugin that fails to import or validate is kept with its error: it shows as
        unavailable in `list_platforms()` and makes `load_platform()` fail if chosen.
        """
        return cls(PluginManager.discover())

    def register_plugin(self, plugin: object, name: str, version: str = "0") -> None:
        """Register an in-process platform plugin (a module or any object with hookimpls).

        Validates it as entry point plugins are and raises `PlatformError` if it is bad.
        """
        try:
            self.plugins.register(plugin, PLATFORM, name, IN_PROCESS, version)
        except PluginError as exc:
            raise PlatformError(str(exc)) from None

    @property
    def names(self) -> list[str]:
        return [record.name for record in self.plugins.records(PLATFORM)]

    def list_platforms(self) -> list[PlatformInfo]:
        """Every registered plugin, whether it is available and why, sorted by name."""
        return [self._probe(name)[0] for name in self.names]

    def device_spec(self, device: str) -> tuple[str, HardwareSpec]:
        """The `HardwareSpec` of `device` (a name such as "H200") from the first plugin
        whose hardware table holds it, with that plugin's name. Plugins are asked in name
        order, available or not (a table needs no device); those whose
        `tokenmill_hardware_spec` takes no `device` argument have no table and are not
        asked. Raises `PlatformError` naming the device and the plugins asked."""
        asked = []
        for record in self.plugins.records(PLATFORM):
            if record.plugin is None or "device" not in self.plugins.hook_args(
                    record, "tokenmill_hardware_spec"):
                continue
            asked.append(record.name)
            call = self._caller(record.name)
            spec = call("tokenmill_hardware_spec", platform=None, device=device)
            if spec is not None:
                return record.name, check_hardware_spec(record.name, "bfloat16", spec)
        raise PlatformError(
            f"no installed platform plugin's hardware table holds device {device!r} (asked: "
            f"{', '.join(asked) or 'none'}); name a device of those tables (H200, B200, "
            "MI300X, TPU v5e, ...) or install the plugin of its vendor"
        )

    def load_platform(self, name: str | None = None) -> ActivePlatform:
        """Choose and activate a platform; see the module docstring for the rules."""
        chosen = name or os.environ.get(PLATFORM_ENV) or None
        source = "argument" if name else f"${PLATFORM_ENV}"
        if chosen is None:
            chosen = self._only_available()
        record = self.plugins.record(PLATFORM, chosen)
        if record is None:
            known = ", ".join(self.names) or "none installed"
            raise PlatformError(
                f"unknown platform {chosen!r} (from {source}); installed platforms: {known}. "
                f"Pick one of them or {_INSTALL_HINT}."
            )
        if record.plugin is None:
            raise PlatformError(f"platform plugin {chosen!r} is broken: {record.error}")
        detection = self._detect(chosen)
        if not detection.available:
            raise PlatformError(f"platform {chosen!r} is not available: {detection.reason}")
        assert record.api_version is not None
        return ActivePlatform(chosen, record.version, self._caller(chosen),
                              self.plugins.implemented(record), record.api_version, self.plugins,
                              self.plugins.hook_parts(record))

    def _only_available(self) -> str:
        if not self.names:
            raise PlatformError(f"no tokenmill platform plugin is installed; {_INSTALL_HINT}")
        probes = [self._probe(name) for name in self.names]
        infos = [info for info, _ in probes]
        available = [info.name for info in infos if info.available]
        if len(available) == 1 and not any(broken for _, broken in probes):
            return available[0]
        listing = "; ".join(f"{i.name}: {'available' if i.available else i.reason}" for i in infos)
        if not available:
            raise PlatformError(f"no platform is available ({listing}); {_INSTALL_HINT}")
        raise PlatformError(
            f"several platforms are installed ({listing}) and none was chosen; pass a name "
            f"or set ${PLATFORM_ENV} to one of {available}"
        )

    def _probe(self, name: str) -> tuple[PlatformInfo, bool]:
        """(what `list_platforms` shows for `name`, whether the plugin is broken).

        A plugin that failed to load, or whose probe or activation raised, is broken: it is
        shown as unavailable with the error as the reason.
        """
        record = self.plugins.record(PLATFORM, name)
        assert record is not None
        about = {"name": name, "distribution": record.distribution, "version": record.version,
                 "api_version": record.api_version}
        if record.plugin is None:
            return PlatformInfo(**about, available=False, reason=record.error), True
        try:
            detection = self._detect(name)
            capabilities = None
            if detection.available:
                platform = check_platform(name, self._caller(name)("tokenmill_platform"))
                capabilities = platform.capabilities
        except PluginError as exc:
            logger.warning("%s", exc)
            return PlatformInfo(**about, available=False, reason=str(exc)), True
        info = PlatformInfo(
            **about,
            available=detection.available,
            reason=detection.reason,
            capabilities=capabilities,
        )
        return info, False

    def _detect(self, name: str) -> DetectionResult:
        result = self._caller(name)("tokenmill_detect")
        return check_type(name, "tokenmill_detect", result, DetectionResult)

    def _caller(self, name: str) -> Callable[..., object]:
        call = self.plugins.caller(PLATFORM, name)

        def platform_call(hook_name: str, **kwargs: object) -> object:
            try:
                return call(hook_name, **kwargs)
            except PlatformError:
                raise
            except PluginError as exc:
                raise PlatformError(str(exc)) from exc.__cause__

        return platform_call


def list_platforms(registry: PlatformRegistry | None = None) -> list[PlatformInfo]:
    """Every installed platform plugin (entry points), whether it is available and why."""
    return (registry or PlatformRegistry.discover()).list_platforms()


def load_platform(
    name: str | None = None, registry: PlatformRegistry | None = None
) -> ActivePlatform:
    """Activate the platform `name`, else `$TOKENMILL_PLATFORM`, else the one available.

    Raises `PlatformError` when none is installed (saying how to install the CPU plugin),
    when several are available and none was chosen (listing them), when the name is
    unknown (listing the known ones), or when the chosen one is unavailable or broken.
    """
    return (registry or PlatformRegistry.discover()).load_platform(name)


def device_spec(
    device: str, registry: PlatformRegistry | None = None
) -> tuple[str, HardwareSpec]:
    """(plugin name, `HardwareSpec`) of a device named in an installed plugin's hardware
    table; see `PlatformRegistry.device_spec`."""
    return (registry or PlatformRegistry.discover()).device_spec(device)


def register_plugin(plugin: object, name: str, registry: PlatformRegistry) -> PlatformRegistry:
    """Register an in-process plugin on `registry` and return the registry."""
    registry.register_plugin(plugin, name)
    return registry


__all__ = [
    "ActivePlatform",
    "PlatformError",
    "PlatformInfo",
    "PlatformRegistry",
    "list_platforms",
    "load_platform",
    "register_plugin",
]
