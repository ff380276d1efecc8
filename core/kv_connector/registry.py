"""KV tiers as plugins: the `kv_tier` kind of the plugin manager
(tokenmill.platforms.plugins), entry point group `tokenmill.kv_tiers`.

A KV tier plugin implements `tokenmill_kv_tiers() -> {name: make(options, context)}`. The
built-in tiers (host, disk, redis, rediss, valkey) are this module's hooks, registered in
the core's own pyproject.toml on the same group, so a third-party tier (Mooncake's store,
say) installs beside them and is chosen the same way: the remote URL's scheme is the tier
name (`--kv-offload-remote mooncake://...` uses the `mooncake` tier).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from tokenmill.kv_connector.objects import KVLayout, ObjectCodec
from tokenmill.kv_connector.stack import TierStack
from tokenmill.platforms.interfaces import Allocator
from tokenmill.platforms.kv_tier import KVTier, TierContext, TierFactory, parse_size
from tokenmill.platforms.plugins import KV_TIER, PluginManager

hookimpl = pluggy.HookimplMarker("tokenmill")


def tier_context(layout: KVLayout, host_allocator: Callable[[], Allocator]) -> TierContext:
    """The context tier factories get for arena objects of `layout`."""
    return TierContext(layout.object_bytes, layout.fingerprint(), host_allocator)


def _check_factory(name: str, factory: object) -> str | None:
    return None if callable(factory) else f"is {factory!r}, not a factory function"


def tier_factories(plugins: PluginManager | None = None) -> dict[str, TierFactory]:
    """Installed tier factories by name, from every KV tier plugin (the core's included)."""
    plugins = plugins if plugins is not None else PluginManager.discover([KV_TIER])
    named = plugins.named(KV_TIER, "tokenmill_kv_tiers", _check_factory)
    return {name: factory for name, (_, factory) in named.items()}


def make_tier(
    name: str, options: Mapping[str, Any], context: TierContext,
    plugins: PluginManager | None = None,
) -> KVTier:
    factories = tier_factories(plugins)
    if name not in factories:
        raise ValueError(
            f"no KV tier {name!r} is installed (KV tier plugins, entry point group "
            f"{KV_TIER.entry_point_group!r}); installed: {sorted(factories)}"
        )
    tier = factories[name](options, context)
    if not isinstance(tier, KVTier):
        raise TypeError(f"KV tier {name!r} returned {type(tier).__name__}, not a KVTier")
    return tier


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """Which tiers to stack; each None leaves its tier out."""

    host_bytes: int | None = None
    disk_path: str | None = None
    disk_bytes: int | None = None
    remote: str | None = None  # URL; its scheme names the tier's entry point
    # objects in shared tiers must carry an HMAC-SHA256 tag under this key (objects.py)
    mac_key: bytes | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_path or self.remote)

    def __post_init__(self) -> None:
        if self.disk_path is not None and self.disk_bytes is None:
            raise ValueError(
                f"kv_offload_disk_path={self.disk_path!r} needs kv_offload_disk_bytes "
                "(the most the disk tier may hold, e.g. 100GiB)"
            )
        if self.disk_bytes is not None and self.disk_path is None:
            raise ValueError("kv_offload_disk_bytes is set without kv_offload_disk_path")
        if self.remote is not None and "://" not in self.remote:
            raise ValueError(
                f"kv_offload_remote={self.remote!r} is not a URL; write e.g. redis://127.0.0.1:6379"
            )


def build_stack(
    config: OffloadConfig, layout: KVLayout, host_allocator: Callable[[], Allocator],
    plugins: PluginManager | None = None,
) -> TierStack:
    """The tier stack `config` asks for, fastest first, checking objects of `layout`
    (and their MAC tags under `config.mac_key`)."""
    codec = ObjectCodec(layout.payload_bytes, config.mac_key)
    context = tier_context(layout, host_allocator)
    plugins = plugins if plugins is not None else PluginManager.discover([KV_TIER])
    tiers: list[KVTier] = []
    try:
        if config.host_bytes:
            tiers.append(make_tier("host", {"bytes": config.host_bytes}, context, plugins))
        if config.disk_path:
            opts = {"path": config.disk_path, "bytes": config.disk_bytes}
            tiers.append(make_tier("disk", opts, context, plugins))
        if config.remote:
            scheme = config.remote.split("://", 1)[0].lower()
            tiers.append(make_tier(scheme, {"url": config.remote}, context, plugins))
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return TierStack(tiers, codec)


# ---- the built-in tiers: a KV tier plugin like any other (pyproject.toml) ----------------
@hookimpl
def tokenmill_api_version() -> str:
    return "1.6"


@hookimpl
def tokenmill_kv_tiers() -> dict[str, TierFactory]:
    return {"host": make_host_tier, "disk": make_disk_tier, "redis": make_redis_tier,
            "rediss": make_redis_tier, "valkey": make_redis_tier}


def make_host_tier(options: Mapping[str, Any], context: TierContext) -> KVTier:
    from tokenmill.kv_connector.host import HostMemoryTier

    return HostMemoryTier(
        context.host_allocator(), parse_size(options["bytes"], "kv_offload_host_bytes"),
        context.object_bytes,
    )


def make_disk_tier(options: Mapping[str, Any], context: TierContext) -> KVTier:
    from tokenmill.kv_connector.disk import DiskTier

    # one directory per layout: another model's objects never share an index
    path = f"{options['path']}/{context.layout_fingerprint.hex()[:16]}"
    return DiskTier(path, parse_size(options["bytes"], "kv_offload_disk_bytes"))


def make_redis_tier(options: Mapping[str, Any], context: TierContext) -> KVTier:
    from tokenmill.kv_connector.redis_tier import RedisTier

    url = str(options["url"])
    if url.startswith("valkey"):  # the same protocol; redis-py knows only its own schemes
        url = "redis" + url[len("valkey"):]
    return RedisTier(url)
