"""One pluggy manager for every extension point of tokenmill.

A plugin is a module (or object) whose `tokenmill_*` functions carry
`pluggy.HookimplMarker("tokenmill")`. Its kind says which hooks it may implement and
where it is announced:

| kind | entry point group | hooks |
|---|---|---|
| platform | `tokenmill.platforms` | the platform hooks (`tokenmill_detect`, ...) |
| kv_tier | `tokenmill.kv_tiers` | `tokenmill_kv_tiers` |
| kv_transport | `tokenmill.kv_transports` | `tokenmill_kv_transports` |
| tool_parser | `tokenmill.tool_parsers` | `tokenmill_tool_parsers` |
| reasoning_parser | `tokenmill.reasoning_parsers` | `tokenmill_reasoning_parsers` |
| model_runner | `tokenmill.model_runners` | `tokenmill_model_runner` |

A model runner is asked of the active platform's plugin first, then of the model_runner
plugins (the core's own runner is one, asked last), so the core's runner is built the
way a plugin's is.

Every plugin of every kind gets the same validation at registration (`register`):
each `tokenmill_*` attribute is a hook of its kind and marked `@hookimpl`; pluggy checks
the argument names; the kind's required hooks and `tokenmill_api_version` are present;
the declared version is compatible with the core's; no hook it implements is newer than
that version (tokenmill.platforms.versions). A broken plugin found through its entry point
is kept with its error and listed, so one bad plugin never hides the others.
The core's own tiers, parsers and model runner are plugins on the same groups (the core's
pyproject.toml), found and validated like any other; one the metadata Python reads does
not announce (a stale `tokenmill.egg-info` in the current directory) is registered from
the core itself, with a warning (`CORE_PLUGINS`).

Adding a kind is one small step: its hookspec in hookspecs.py
(with its `HOOKS_SINCE` entry), one `PluginKind` added to `KINDS`, and the core's call
site asking `PluginManager.named(kind, hook, check)` for what the plugins provide. A
kind with no call site in the core is not added.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pluggy

from tokenmill.platforms import hookspecs
from tokenmill.platforms.versions import (
    HOOK_ARGS_SINCE,
    HOOKS_SINCE,
    PLUGIN_API_VERSION,
    newer_than,
    parse_version,
)

logger = logging.getLogger(__name__)

IN_PROCESS = "<in-process>"


class PluginError(RuntimeError):
    """A plugin is missing, broken, or returned something the contract does not allow."""


@dataclass(frozen=True, slots=True)
class PluginKind:
    """One extension point: where its plugins are announced and which hooks they have."""

    name: str  # "platform", "kv_tier", ...
    entry_point_group: str
    hooks: frozenset[str]  # the hooks a plugin of this kind may implement
    required: frozenset[str]  # of those, the ones it must implement
    summary: str  # one line for `tokenmill plugins`
    # the hook whose answer is {item name: item} (`PluginManager.named`); None for kinds
    # asked per call (a platform, a model runner)
    named_hook: str | None = None


PLATFORM = PluginKind(
    "platform", hookspecs.ENTRY_POINT_GROUP, hookspecs.PLATFORM_HOOKS, hookspecs.REQUIRED_HOOKS,
    "a device: attention backends, ops, allocators, collectives, optionally a model runner",
)
KV_TIER = PluginKind(
    "kv_tier", "tokenmill.kv_tiers", frozenset({"tokenmill_kv_tiers"}),
    frozenset({"tokenmill_kv_tiers"}), "KV offload tiers by URL scheme (host, disk, redis, ...)",
    "tokenmill_kv_tiers",
)
TOOL_PARSER = PluginKind(
    "tool_parser", "tokenmill.tool_parsers", frozenset({"tokenmill_tool_parsers"}),
    frozenset({"tokenmill_tool_parsers"}), "--tool-call-parser formats", "tokenmill_tool_parsers",
)
REASONING_PARSER = PluginKind(
    "reasoning_parser", "tokenmill.reasoning_parsers",
    frozenset({"tokenmill_reasoning_parsers"}), frozenset({"tokenmill_reasoning_parsers"}),
    "--reasoning-parser formats", "tokenmill_reasoning_parsers",
)
MODEL_RUNNER = PluginKind(
    "model_runner", "tokenmill.model_runners", frozenset({"tokenmill_model_runner"}),
    frozenset({"tokenmill_model_runner"}),
    "model runners any platform may use when its own plugin brings none (the core's)",
)
KV_TRANSPORT = PluginKind(
    "kv_transport", "tokenmill.kv_transports", frozenset({"tokenmill_kv_transports"}),
    frozenset({"tokenmill_kv_transports"}),
    "KV transports of prefill/decode disaggregation (nixl, mooncake, ...)",
    "tokenmill_kv_transports",
)
KINDS: tuple[PluginKind, ...] = (PLATFORM, KV_TIER, KV_TRANSPORT, TOOL_PARSER, REASONING_PARSER,
                                 MODEL_RUNNER)
CORE_PLUGIN_NAME = "tokenmill"  # the core's own plugins of each non-platform kind
# kind -> the module of the core's own plugin, as the core's pyproject.toml announces it
# (tests/test_plugin_manager.py holds the two equal). `discover` registers one directly
# when the metadata Python reads does not announce it (see `_add_missing_core_plugins`).
CORE_PLUGINS = {
    "kv_tier": "tokenmill.kv_connector.registry",
    "tool_parser": "tokenmill.server.tool_parsers",
    "reasoning_parser": "tokenmill.server.reasoning",
    "model_runner": "tokenmill.worker.runner_plugin",
}


@dataclass(frozen=True, slots=True)
class PluginRecord:
    """One registered plugin, as `tokenmill plugins` lists it."""

    kind: PluginKind
    name: str  # its entry point name (what `--platform`, a URL scheme, ... refers to)
    distribution: str  # the distribution that installed it, or "<in-process>"
    version: str  # that distribution's version
    api_version: str | None  # what its tokenmill_api_version declared (None: broken)
    plugin: object | None  # None when it failed to import or validate
    error: str = ""


class PluginManager:
    """Every plugin of every kind on one pluggy manager (project name "tokenmill").

    `PluginManager.discover()` loads the entry points of every kind; `PluginManager()`
    starts empty (tests and in-process plugins, added with `register`).
    """

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._records: dict[tuple[str, str], PluginRecord] = {}

    @classmethod
    def discover(cls, kinds: Iterable[PluginKind] = KINDS) -> PluginManager:
        """A manager holding every installed plugin of `kinds`, broken ones with their
        error (an import that fails is logged and kept, not raised)."""
        manager = cls()
        for kind in kinds:
            for entry_point in metadata.entry_points(group=kind.entry_point_group):
                dist = entry_point.dist
                dist_name = dist.name if dist is not None else "<unknown distribution>"
                dist_version = dist.version if dist is not None else "0"
                try:
                    plugin = entry_point.load()
                except Exception as exc:  # kept and listed: one broken plugin must not hide the rest
                    error = f"cannot import {entry_point.value!r}: {exc!r}"
                    logger.warning("%s plugin %r: %s", kind.name, entry_point.name, error,
                                   exc_info=True)
                    manager._keep(PluginRecord(kind, entry_point.name, dist_name, dist_version,
                                               None, None, error))
                    continue
                manager.register(plugin, kind, entry_point.name, dist_name, dist_version,
                                 keep_errors=True)
        manager._add_missing_core_plugins(kinds)
        return manager

    def _add_missing_core_plugins(self, kinds: Iterable[PluginKind]) -> None:
        """Register the core's own plugin of each kind whose entry points did not include
        it, from the module the core's pyproject.toml names, with a warning. Entry points
        come from the first `tokenmill` metadata on sys.path: a `tokenmill.egg-info` of an
        older install left in a source checkout hides the installed metadata from `python
        -m ...` and scripts started in that directory (sys.path[0] is the current
        directory for them), and without this the engine stopped there with "no model
        runner" while the same engine in a script elsewhere ran."""
        for kind in kinds:
            module = CORE_PLUGINS.get(kind.name)
            if module is None or self.record(kind, CORE_PLUGIN_NAME) is not None:
                continue
            logger.warning(
                "the core's %s plugin (%s) is not announced in entry point group %r of the "
                "tokenmill metadata Python read (%s); registering it from the core itself. "
                "A tokenmill.egg-info older than the installed tokenmill, in the current "
                "directory, does this: delete it or run `pip install -e .` again there",
                kind.name, module, kind.entry_point_group, _metadata_location())
            try:
                plugin = importlib.import_module(module)
            except ImportError as exc:
                error = f"cannot import {module!r}: {exc!r}"
                logger.warning("%s plugin %r: %s", kind.name, CORE_PLUGIN_NAME, error)
                self._keep(PluginRecord(kind, CORE_PLUGIN_NAME, "tokenmill", "0", None, None,
                                        error))
                continue
            self.register(plugin, kind, CORE_PLUGIN_NAME, "tokenmill", _core_version(),
                          keep_errors=True)

    def register(
        self, plugin: object, kind: PluginKind, name: str, distribution: str = IN_PROCESS,
        version: str = "0", keep_errors: bool = False,
    ) -> None:
        """Validate `plugin` as a plugin of `kind` named `name` and register it.

        Raises `PluginError` naming the plugin when it is invalid, unless `keep_errors`,
        which keeps it as broken (listed with its error, never called).
        """
        if (kind.name, name) in self._records:
            other = self._records[(kind.name, name)].distribution
            raise PluginError(f"two {kind.name} plugins are named {name!r} ({other} and "
                              f"{distribution}); uninstall one of them")
        try:
            api_version = self._validate_and_register(plugin, kind, name)
        except PluginError as exc:
            if not keep_errors:
                raise
            logger.warning("%s", exc)
            self._keep(PluginRecord(kind, name, distribution, version, None, None, str(exc)))
            return
        self._keep(PluginRecord(kind, name, distribution, version, api_version, plugin))

    def records(self, kind: PluginKind) -> list[PluginRecord]:
        """The plugins of `kind`, working and broken, sorted by name."""
        return sorted((r for (k, _), r in self._records.items() if k == kind.name),
                      key=lambda r: r.name)

    def record(self, kind: PluginKind, name: str) -> PluginRecord | None:
        return self._records.get((kind.name, name))

    def implemented(self, record: PluginRecord) -> frozenset[str]:
        """The hooks `record`'s plugin implements."""
        return frozenset(hook for hook, _ in _hookimpls(self._pm, record.plugin))

    def hook_parts(self, record: PluginRecord) -> tuple[tuple[str, str], ...]:
        """(what, the version that introduced it) for every hook and versioned hook
        argument `record`'s plugin implements."""
        parts = []
        for hook, impl in sorted(_hookimpls(self._pm, record.plugin), key=lambda h: h[0]):
            parts.append((f"hook {hook}", HOOKS_SINCE[hook]))
            parts += [(f"argument {arg!r} of {hook}", HOOK_ARGS_SINCE[(hook, arg)])
                      for arg in impl.argnames if (hook, arg) in HOOK_ARGS_SINCE]
        return tuple(parts)

    def hook_args(self, record: PluginRecord, hook: str) -> tuple[str, ...]:
        """The argument names `record`'s implementation of `hook` takes (a plugin may take
        a subset of the hook's); () when it does not implement it."""
        for name, impl in _hookimpls(self._pm, record.plugin):
            if name == hook:
                return tuple(impl.argnames)
        return ()

    def caller(self, kind: PluginKind, name: str) -> Callable[..., object]:
        """Calls a hook of that one plugin only (pluggy's `subset_hook_caller`); an
        exception it raises becomes a `PluginError` naming the plugin and the hook."""
        record = self._records[(kind.name, name)]
        if record.plugin is None:
            raise PluginError(f"{kind.name} plugin {name!r} is broken: {record.error}")
        return self._caller_for(record.plugin, f"{kind.name} plugin {name!r}")

    def named(
        self, kind: PluginKind, hook: str, check: Callable[[str, object], str | None],
    ) -> dict[str, tuple[str, object]]:
        """What the working plugins of `kind` provide through `hook` (each returns a dict
        of item name -> item), merged: item name -> (plugin name, item).

        `check(item_name, item)` returns why an item is bad (None: fine). A result that
        is not a dict of non-empty names, a bad item, or two plugins providing the same
        name is a `PluginError` naming the plugin(s).
        """
        merged: dict[str, tuple[str, object]] = {}
        for record in self.records(kind):
            if record.plugin is None:
                continue
            where = f"{kind.name} plugin {record.name!r}"
            items = self.caller(kind, record.name)(hook)
            if not isinstance(items, dict) or not all(isinstance(k, str) and k for k in items):
                raise PluginError(f"{where}: {hook} returned {items!r}; expected a dict of "
                                  "non-empty names")
            for item_name, item in items.items():
                problem = check(item_name, item)
                if problem is not None:
                    raise PluginError(f"{where}: {hook} item {item_name!r} {problem}")
                if item_name in merged:
                    raise PluginError(f"{kind.name} {item_name!r} is provided by two plugins, "
                                      f"{merged[item_name][0]!r} and {record.name!r}; "
                                      "uninstall one of them")
                merged[item_name] = (record.name, item)
        return merged

    # ---- validation ------------------------------------------------------------------
    def _keep(self, record: PluginRecord) -> None:
        self._records[(record.kind.name, record.name)] = record

    def _validate_and_register(self, plugin: object, kind: PluginKind, name: str) -> str:
        where = f"{kind.name} plugin {name!r}"
        _check_hook_names(where, kind, plugin)
        try:
            self._pm.register(plugin, name=f"{kind.name}:{name}")
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise PluginError(f"{where} is invalid: {exc}") from exc
        try:
            self._pm.check_pending()
            implemented = {hook for hook, _ in _hookimpls(self._pm, plugin)}
            missing = (kind.required | {"tokenmill_api_version"}) - implemented
            if missing:
                raise PluginError(f"{where} does not implement the required hooks "
                                  f"{sorted(missing)}; see tokenmill.platforms.hookspecs")
            declared = self._caller_for(plugin, where)("tokenmill_api_version")
            check_api_version(where, declared)
            record = PluginRecord(kind, name, IN_PROCESS, "0", declared, plugin)
            for what, since in self.hook_parts(record):
                check_since(where, declared, what, since)
            return declared
        except (pluggy.PluginValidationError, PluginError) as exc:
            self._pm.unregister(plugin)
            if isinstance(exc, PluginError):
                raise
            raise PluginError(f"{where} is invalid: {exc}") from exc

    def _caller_for(self, plugin: object, where: str) -> Callable[..., object]:
        others = [p for p in self._pm.get_plugins() if p is not plugin]

        def call(hook_name: str, **kwargs: object) -> object:
            hook = self._pm.subset_hook_caller(hook_name, others)
            try:
                return hook(**kwargs)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(f"{where}: {hook_name} raised {exc!r}") from exc

        return call


def check_api_version(where: str, declared: object) -> None:
    """The declared version must be "major.minor" with the core's major and a minor at
    most the core's."""
    core = parse_version(PLUGIN_API_VERSION)
    plugin = parse_version(declared)
    assert core is not None
    if plugin is None:
        raise PluginError(f"{where} returned API version {declared!r}; expected a "
                          f"'major.minor' string such as {PLUGIN_API_VERSION!r}")
    if plugin[0] != core[0] or plugin[1] > core[1]:
        raise PluginError(f"{where} targets plugin API {declared}, but this tokenmill provides "
                          f"{PLUGIN_API_VERSION}; install a matching version of the plugin or core")


def check_since(where: str, declared: str, what: str, since: str) -> None:
    """Refuse `what` (introduced in `since`) from a plugin that declared an older version."""
    if newer_than(since, declared):
        raise PluginError(
            f"{where} declares plugin API {declared} but uses {what}, introduced in {since}; "
            f"declare {since} or newer in tokenmill_api_version (docs/contract-changelog.md "
            "says what changed)"
        )


def _hookimpls(pm: pluggy.PluginManager, plugin: object) -> list[tuple[str, object]]:
    return [
        (caller.name, impl)
        for caller in pm.get_hookcallers(plugin) or []
        for impl in caller.get_hookimpls()
        if impl.plugin is plugin
    ]


def _check_hook_names(where: str, kind: PluginKind, plugin: object) -> None:
    """Reject `tokenmill_*` attributes that are not hooks of `kind`, or lack `@hookimpl`."""
    allowed = kind.hooks | {"tokenmill_api_version"}
    for attr in dir(plugin):
        if not attr.startswith("tokenmill_") or not callable(getattr(plugin, attr)):
            continue
        if attr not in HOOKS_SINCE:
            raise PluginError(f"{where} defines unknown hook {attr!r}; known hooks are "
                              f"{sorted(HOOKS_SINCE)}")
        if attr not in allowed:
            raise PluginError(f"{where} defines {attr!r}, which is not a {kind.name} hook; "
                              f"a {kind.name} plugin implements {sorted(allowed)}")
        if getattr(getattr(plugin, attr), f"{hookspecs.PROJECT_NAME}_impl", None) is None:
            raise PluginError(f"{where} defines {attr!r} without "
                              f"@pluggy.HookimplMarker({hookspecs.PROJECT_NAME!r}); decorate it")


def _metadata_location() -> str:
    """Where the `tokenmill` distribution metadata Python finds first lives, for messages."""
    try:
        dist = metadata.distribution("tokenmill")
    except metadata.PackageNotFoundError:
        return "none found: tokenmill is not installed"
    return str(Path(str(dist.locate_file(""))).resolve())


def _core_version() -> str:
    """The running core's version (the package is imported by then: the contract lives in
    it), read without importing the core from the contract."""
    return str(getattr(sys.modules.get("tokenmill"), "__version__", "0"))
