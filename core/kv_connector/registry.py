"""KV tiers as plugins: the entry point group `tokenmill.kv_tiers`.

Each entry point names a factory `make(options, context) -> KVTier`. The built-in tiers
(host, disk, redis, valkey) are registered in the core's own pyproject.toml on the same
group, so a third-party tier (Mooncake's store, say) installs beside them and is chosen
the same way: the remote URL's scheme is the entry point name
(`--kv-offload-remote mooncake://...` loads the `mooncake` tier).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from tokenmill.kv_connector.objects import KVLayout
from tokenmill.kv_connector.stack import TierStack
from tokenmill.kv_connector.tier import KVTier
from tokenmill.platforms.interfaces import Allocator

ENTRY_POINT_GROUP = "tokenmill.kv_tiers"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(value: int | str, name: str = "size") -> int:
    """Bytes from an int or a string like "8GiB", "100GB", "512MiB", "4096".

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB)
    powers of 1000. Raises ValueError naming `name` and the value.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a size")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        if m is None:
            raise ValueError(f"{name}={value!r} is not a size; write e.g. 8GiB, 100GB or 4096")
        base = 1024 if m.group(3) else 1000
        n = int(float(m.group(1)) * base ** _POWERS[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"{name}={value!r} must be at least one byte")
    return n


@dataclass(frozen=True, slots=True)
class TierContext:
    """What a tier factory may use besides its own options."""

    layout: KVLayout
    host_allocator: Callable[[], Allocator]  # the platform's HOST_STAGING allocator


TierFactory = Callable[[Mapping[str, Any], TierContext], KVTier]


def tier_factories() -> dict[str, TierFactory]:
    """Installed tier factories by entry point name (loaded lazily by `make_tier`)."""
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def make_tier(name: str, options: Mapping[str, Any], context: TierContext) -> KVTier:
    eps = tier_factories()
    if name not in eps:
        raise ValueError(
            f"no KV tier {name!r} is installed (entry point group {ENTRY_POINT_GROUP!r}); "
            f"installed: {sorted(eps)}"
        )
    tier = eps[name].load()(options, context)
    if not isinstance(tier, KVTier):
        raise TypeError(f"KV tier entry point {name!r} returned {type(tier).__name__}, not a KVTier")
    return tier


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """Which tiers to stack; each None leaves its tier out."""

    host_bytes: int | None = None
    disk_path: str | None = None
    disk_bytes: int | None = None
    remote: str | None = None  # URL; its scheme names the tier's entry point

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


def build_stack(config: OffloadConfig, context: TierContext) -> TierStack:
    """The tier stack `config` asks for, fastest first."""
    tiers: list[KVTier] = []
    try:
        if config.host_bytes:
            tiers.append(make_tier("host", {"bytes": config.host_bytes}, context))
        if config.disk_path:
            opts = {"path": config.disk_path, "bytes": config.disk_bytes}
            tiers.append(make_tier("disk", opts, context))
        if config.remote:
            scheme = config.remote.split("://", 1)[0].lower()
            tiers.append(make_tier(scheme, {"url": config.remote}, context))
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return TierStack(tiers)


# ---- the built-in factories (registered in pyproject.toml) ------------------------------
def make_host_tier(options: Mapping[str, Any], context: TierContext) -> KVTier:
    from tokenmill.kv_connector.host import HostMemoryTier

    return HostMemoryTier(
        context.host_allocator(), parse_size(options["bytes"], "kv_offload_host_bytes"),
        context.layout.object_bytes,
    )


def make_disk_tier(options: Mapping[str, Any], context: TierContext) -> KVTier:
    from tokenmill.kv_connector.disk import DiskTier

    # one directory per layout: another model's objects never share an index
    path = f"{options['path']}/{context.layout.fingerprint().hex()[:16]}"
    return DiskTier(path, parse_size(options["bytes"], "kv_offload_disk_bytes"))


def make_redis_tier(options: Mapping[str, Any], context: TierContext) -> KVTier:
    from tokenmill.kv_connector.redis_tier import RedisTier

    url = str(options["url"])
    if url.startswith("valkey"):  # the same protocol; redis-py knows only its own schemes
        url = "redis" + url[len("valkey"):]
    return RedisTier(url)
