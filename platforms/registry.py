"""Find, validate, select and activate platform plugins.

Plugins are discovered through the entry point group `tokenmill.platforms` and
registered on one pluggy `PluginManager` under their entry point name. Registration
validates the contract (hook names, signatures, required hooks, API version) and fails
loudly with the plugin's name. Hooks are called on one plugin at a time through
`PluginManager.subset_hook_caller`, so several installed plugins never mix.

Selection (`load_platform`): an explicit name, else `$TOKENMILL_PLATFORM`, else the one
available plugin. The result is an `ActivePlatform`, the core's only handle on a plugin.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

import pluggy

from tokenmill.ops import Ops, resolve_ops
from tokenmill.platforms import hookspecs
from tokenmill.platforms.interfaces import (
    OP_NAMES,
    PLUGIN_API_VERSION,
    Allocator,
    AllocatorPurpose,
    AttentionBackend,
    AttentionSpec,
    Capabilities,
    Communicator,
    DetectionResult,
    GraphCapture,
    HardwareSpec,
    ModelRunnerBase,
    ModelRunnerContext,
    Platform,
)

logger = logging.getLogger(__name__)

PLATFORM_ENV = "TOKENMILL_PLATFORM"
IN_PROCESS = "<in-process>"
_INSTALL_HINT = "install one, e.g. `pip install plugins/cpu` (distribution tokenmill-cpu)"


class PlatformError(RuntimeError):
    """A platform plugin is missing, broken, unavailable or cannot be chosen."""


@dataclass(frozen=True, slots=True)
class PlatformInfo:
    """One installed plugin, as `list_platforms()` and `tokenmill platforms` show it."""

    name: str  # entry point name, what `--platform` takes
    distribution: str  # the distribution that installed it, or "<in-process>"
    version: str  # that distribution's version
    available: bool
    reason: str  # why (not) available, from the probe, or the load error
    capabilities: Capabilities | None = None  # only when available


@dataclass(slots=True)
class _Plugin:
    name: str
    distribution: str
    version: str
    plugin: object | None  # None when loading or validation failed
    error: str = ""


class ActivePlatform:
    """The activated plugin: the one object the engine asks for backends, ops and memory.

    Built by `load_platform`; validates what the plugin returns and fails naming it.
    Allocators are created once per purpose and kept, so their accounting is global.
    """

    def __init__(
        self, name: str, version: str, call: Callable[..., object], implemented: frozenset[str]
    ) -> None:
        self.name = name
        self.version = version
        self._call = call
        self.platform: Platform = _check_platform(name, call("tokenmill_platform"))
        if self.platform.capabilities.collectives and "tokenmill_communicator" not in implemented:
            raise PlatformError(
                f"platform plugin {name!r} declares collectives but does not implement "
                "tokenmill_communicator; implement it or declare collectives=False"
            )
        self._backends = _check_backends(
            name, self.platform, call("tokenmill_attention_backends", platform=self.platform)
        )
        self._ops = resolve_ops(
            _check_ops(name, call("tokenmill_ops", platform=self.platform)),
            source=f"platform plugin {name!r}",
        )
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
            self._allocators[purpose] = _check_allocator(self.name, purpose, allocator)
        return self._allocators[purpose]

    def communicator(self, group: object | None = None) -> Communicator:
        """Collectives over `group` (a torch.distributed ProcessGroup; None for the world)."""
        result = self._call("tokenmill_communicator", platform=self.platform, group=group)
        if result is None:
            raise PlatformError(
                f"platform plugin {self.name!r} does not implement tokenmill_communicator; "
                "it cannot run with tensor/pipeline/expert parallelism"
            )
        return _check_type(self.name, "tokenmill_communicator", result, Communicator)

    def hardware_spec(self) -> HardwareSpec:
        """Peak FLOP/s, memory bandwidth and size, as the plugin declares them."""
        spec = self._call("tokenmill_hardware_spec", platform=self.platform)
        return _check_hardware_spec(self.name, self.platform, spec)

    def graph_capture(self, max_num_seqs: int) -> GraphCapture | None:
        """The plugin's decode-step graphs, or None to run eagerly (always None when the
        platform does not declare `capabilities.graphs`)."""
        if not self.platform.capabilities.graphs:
            return None
        result = self._call("tokenmill_graph_capture", platform=self.platform)
        if result is None:
            return None
        graphs = _check_type(self.name, "tokenmill_graph_capture", result, GraphCapture)
        sizes = graphs.batch_sizes(max_num_seqs)
        if (not isinstance(sizes, list) or not sizes
                or any(not isinstance(n, int) or not 0 < n <= max_num_seqs for n in sizes)
                or sizes != sorted(set(sizes))):
            raise PlatformError(
                f"platform plugin {self.name!r}: GraphCapture.batch_sizes({max_num_seqs}) "
                f"returned {sizes!r}; expected ascending distinct ints in [1, {max_num_seqs}]"
            )
        return graphs

    def model_runner(self, context: ModelRunnerContext) -> ModelRunnerBase | None:
        """The plugin's own model runner for `context`, or None for the core's."""
        result = self._call("tokenmill_model_runner", platform=self.platform, context=context)
        if result is None:
            return None
        runner = _check_type(self.name, "tokenmill_model_runner", result, ModelRunnerBase)
        block_bytes = runner.kv_block_bytes()
        if not isinstance(block_bytes, int) or block_bytes < 1:
            raise PlatformError(
                f"platform plugin {self.name!r}: its model runner's kv_block_bytes() returned "
                f"{block_bytes!r}; expected a positive int"
            )
        return runner

    def waivers(self) -> list[tuple[str, str]]:
        """(conformance test id, reason) pairs the plugin asks to waive."""
        result = self._call("tokenmill_waivers", platform=self.platform)
        return _check_waivers(self.name, [] if result is None else result)


class PlatformRegistry:
    """Installed and in-process plugins on one pluggy manager.

    `PlatformRegistry.discover()` loads the entry points; `PlatformRegistry()` starts
    empty (for tests and in-process plugins, added with `register_plugin`).
    """

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._plugins: dict[str, _Plugin] = {}

    @classmethod
    def discover(cls) -> PlatformRegistry:
        """A registry holding every plugin of the entry point group `tokenmill.platforms`.

        A plugin that fails to import or validate is kept with its error: it shows as
        unavailable in `list_platforms()` and makes `load_platform()` fail if chosen.
        """
        registry = cls()
        for entry_point in metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            dist = entry_point.dist
            dist_name = dist.name if dist is not None else "<unknown distribution>"
            dist_version = dist.version if dist is not None else "0"
            try:
                module = entry_point.load()
            except Exception as exc:  # kept and reported: one broken plugin must not hide the rest
                error = f"cannot import {entry_point.value!r}: {exc!r}"
                registry._plugins[entry_point.name] = _Plugin(
                    entry_point.name, dist_name, dist_version, None, error
                )
                logger.warning("platform plugin %r: %s", entry_point.name, error, exc_info=True)
                continue
            registry._add(module, entry_point.name, dist_name, dist_version, keep_errors=True)
        return registry

    def register_plugin(self, plugin: object, name: str, version: str = "0") -> None:
        """Register an in-process plugin (a module or any object with hookimpls).

        Validates it as entry point plugins are and raises `PlatformError` if it is bad.
        """
        self._add(plugin, name, IN_PROCESS, version, keep_errors=False)

    @property
    def names(self) -> list[str]:
        return sorted(self._plugins)

    def list_platforms(self) -> list[PlatformInfo]:
        """Every registered plugin, whether it is available and why, sorted by name."""
        return [self._probe(name)[0] for name in self.names]

    def load_platform(self, name: str | None = None) -> ActivePlatform:
        """Choose and activate a platform; see the module docstring for the rules."""
        chosen = name or os.environ.get(PLATFORM_ENV) or None
        source = "argument" if name else f"${PLATFORM_ENV}"
        if chosen is None:
            chosen = self._only_available()
        elif chosen not in self._plugins:
            known = ", ".join(self.names) or "none installed"
            raise PlatformError(
                f"unknown platform {chosen!r} (from {source}); installed platforms: {known}. "
                f"Pick one of them or {_INSTALL_HINT}."
            )
        record = self._plugins[chosen]
        if record.plugin is None:
            raise PlatformError(f"platform plugin {chosen!r} is broken: {record.error}")
        detection = self._detect(chosen)
        if not detection.available:
            raise PlatformError(f"platform {chosen!r} is not available: {detection.reason}")
        implemented = frozenset(hook for hook, _ in _hookimpls(self._pm, record.plugin))
        return ActivePlatform(chosen, record.version, self._caller(chosen), implemented)

    def _add(self, plugin: object, name: str, dist: str, version: str, keep_errors: bool) -> None:
        if name in self._plugins:
            raise PlatformError(
                f"two platform plugins are named {name!r} ({self._plugins[name].distribution} "
                f"and {dist}); uninstall one of them"
            )
        try:
            self._validate_and_register(plugin, name)
        except PlatformError as exc:
            if not keep_errors:
                raise
            logger.warning("%s", exc)
            self._plugins[name] = _Plugin(name, dist, version, None, str(exc))
            return
        self._plugins[name] = _Plugin(name, dist, version, plugin)

    def _validate_and_register(self, plugin: object, name: str) -> None:
        _check_hook_names(name, plugin)
        try:
            self._pm.register(plugin, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise PlatformError(f"platform plugin {name!r} is invalid: {exc}") from exc
        try:
            self._pm.check_pending()
            implemented = {impl_name for impl_name, _ in _hookimpls(self._pm, plugin)}
            missing = hookspecs.REQUIRED_HOOKS - implemented
            if missing:
                raise PlatformError(
                    f"platform plugin {name!r} does not implement the required hooks "
                    f"{sorted(missing)}; see tokenmill.platforms.hookspecs"
                )
            _check_api_version(name, self._caller_for(plugin)("tokenmill_api_version"))
        except (pluggy.PluginValidationError, PlatformError) as exc:
            self._pm.unregister(plugin)
            if isinstance(exc, PlatformError):
                raise
            raise PlatformError(f"platform plugin {name!r} is invalid: {exc}") from exc

    def _only_available(self) -> str:
        if not self._plugins:
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
        record = self._plugins[name]
        about = {"name": name, "distribution": record.distribution, "version": record.version}
        if record.plugin is None:
            return PlatformInfo(**about, available=False, reason=record.error), True
        try:
            detection = self._detect(name)
            capabilities = None
            if detection.available:
                platform = _check_platform(name, self._caller(name)("tokenmill_platform"))
                capabilities = platform.capabilities
        except PlatformError as exc:
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
        return _check_type(name, "tokenmill_detect", result, DetectionResult)

    def _caller(self, name: str) -> Callable[..., object]:
        return self._caller_for(self._plugins[name].plugin)

    def _caller_for(self, plugin: object) -> Callable[..., object]:
        """Calls one hook of `plugin` only; an exception it raises becomes a `PlatformError`
        naming the plugin and the hook (chained to the original)."""
        others = [p for p in self._pm.get_plugins() if p is not plugin]
        name = self._pm.get_name(plugin)

        def call(hook_name: str, **kwargs: object) -> object:
            hook = self._pm.subset_hook_caller(hook_name, others)
            try:
                return hook(**kwargs)
            except PlatformError:
                raise
            except Exception as exc:
                raise PlatformError(
                    f"platform plugin {name!r}: {hook_name} raised {exc!r}"
                ) from exc

        return call


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


def register_plugin(plugin: object, name: str, registry: PlatformRegistry) -> PlatformRegistry:
    """Register an in-process plugin on `registry` and return the registry."""
    registry.register_plugin(plugin, name)
    return registry


# -- validation ------------------------------------------------------------------------


def _hookimpls(pm: pluggy.PluginManager, plugin: object) -> list[tuple[str, object]]:
    return [
        (caller.name, impl)
        for caller in pm.get_hookcallers(plugin) or []
        for impl in caller.get_hookimpls()
        if impl.plugin is plugin
    ]


def _check_hook_names(name: str, plugin: object) -> None:
    """Reject `tokenmill_*` attributes that are not hooks, or hooks without `@hookimpl`."""
    known = {n for n in dir(hookspecs) if n.startswith("tokenmill_")}
    for attr in dir(plugin):
        if not attr.startswith("tokenmill_") or not callable(getattr(plugin, attr)):
            continue
        if attr not in known:
            raise PlatformError(
                f"platform plugin {name!r} defines unknown hook {attr!r}; known hooks are "
                f"{sorted(known)}"
            )
        marked = getattr(getattr(plugin, attr), f"{hookspecs.PROJECT_NAME}_impl", None)
        if marked is None:
            raise PlatformError(
                f"platform plugin {name!r} defines {attr!r} without "
                f"@pluggy.HookimplMarker({hookspecs.PROJECT_NAME!r}); decorate it"
            )


def _parse_version(text: object) -> tuple[int, int] | None:
    if not isinstance(text, str):
        return None
    parts = text.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def _check_api_version(name: str, version: object) -> None:
    core = _parse_version(PLUGIN_API_VERSION)
    assert core is not None
    plugin = _parse_version(version)
    if plugin is None:
        raise PlatformError(
            f"platform plugin {name!r} returned API version {version!r}; expected a "
            f"'major.minor' string such as {PLUGIN_API_VERSION!r}"
        )
    if plugin[0] != core[0] or plugin[1] > core[1]:
        raise PlatformError(
            f"platform plugin {name!r} targets plugin API {version}, but this tokenmill "
            f"provides {PLUGIN_API_VERSION}; install a matching version of the plugin or core"
        )


def _check_type(name: str, hook: str, value: object, expected: type) -> object:
    if not isinstance(value, expected):
        raise PlatformError(
            f"platform plugin {name!r}: {hook} returned {value!r} "
            f"({type(value).__name__}); expected {expected.__name__}"
        )
    return value


def _check_platform(name: str, platform: object) -> Platform:
    _check_type(name, "tokenmill_platform", platform, Platform)
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


def _check_backends(name: str, platform: Platform, backends: object) -> list[AttentionBackend]:
    hook = "tokenmill_attention_backends"
    if not isinstance(backends, (list, tuple)) or not backends:
        raise PlatformError(
            f"platform plugin {name!r}: {hook} returned {backends!r}; expected a non-empty list"
        )
    for backend in backends:
        _check_type(name, hook, backend, AttentionBackend)
    declared = platform.capabilities.attention_kinds
    kinds = {backend.kind for backend in backends}
    if kinds - declared or declared - kinds:
        raise PlatformError(
            f"platform plugin {name!r}: backends cover attention kinds "
            f"{sorted(k.value for k in kinds)} but the platform declares "
            f"{sorted(k.value for k in declared)}; they must be equal"
        )
    return list(backends)


def _check_ops(name: str, ops: object) -> dict[str, Callable]:
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


def _check_allocator(name: str, purpose: AllocatorPurpose, allocator: object) -> Allocator:
    _check_type(name, "tokenmill_allocator", allocator, Allocator)
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


def _check_hardware_spec(name: str, platform: Platform, spec: object) -> HardwareSpec:
    _check_type(name, "tokenmill_hardware_spec", spec, HardwareSpec)
    assert isinstance(spec, HardwareSpec)
    numbers = {f"peak_flops[{k!r}]": v for k, v in spec.peak_flops.items()}
    numbers["memory_bandwidth"] = spec.memory_bandwidth
    numbers["memory_bytes"] = spec.memory_bytes
    bad = {k: v for k, v in numbers.items() if not isinstance(v, (int, float)) or v <= 0}
    dtype_name = str(platform.default_dtype).removeprefix("torch.")
    if dtype_name not in spec.peak_flops:
        bad[f"peak_flops[{dtype_name!r}]"] = "missing"
    if bad:
        raise PlatformError(f"platform plugin {name!r} returned a bad HardwareSpec: {bad}")
    return spec


def _check_waivers(name: str, waivers: object) -> list[tuple[str, str]]:
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


__all__ = [
    "ActivePlatform",
    "PlatformError",
    "PlatformInfo",
    "PlatformRegistry",
    "list_platforms",
    "load_platform",
    "register_plugin",
]
