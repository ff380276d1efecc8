"""KV transports as plugins of the `kv_transport` kind (tokenmill.platforms.plugins: entry
point group `tokenmill.kv_transports`, hook `tokenmill_kv_transports() -> {name:
factory(context)}`, `tokenmill.platforms.kv_transport`), validated and versioned like every
other plugin and listed by `tokenmill plugins`. NIXL (`tokenmill-kv-nixl`) and Mooncake's
transfer engine (`tokenmill-kv-mooncake`) are the two shipped; `--kv-transport` picks one
by name, and without a choice Mooncake is used where it is installed, else NIXL."""

from __future__ import annotations

import logging
from collections.abc import Callable

from tokenmill.platforms.kv_transport import KVTransport, TransportContext, TransportError
from tokenmill.platforms.plugins import KV_TRANSPORT, PluginManager

logger = logging.getLogger(__name__)

PREFERENCE = ("mooncake", "nixl")  # the default: the first one installed (nixl-cu12
# 1.5.1 without CUDA crashes the process at exit: docs/disaggregation.md)

TransportFactory = Callable[[TransportContext], KVTransport]


def _check_factory(name: str, factory: object) -> str | None:
    return None if callable(factory) else f"is {factory!r}, not a factory function"


def available_transports(plugins: PluginManager | None = None) -> dict[str, TransportFactory]:
    """Every installed transport by name. A plugin that fails to import or to validate
    is logged and left out (one broken plugin never hides the others; `tokenmill plugins`
    shows why)."""
    plugins = plugins if plugins is not None else PluginManager.discover([KV_TRANSPORT])
    for record in plugins.records(KV_TRANSPORT):
        if record.plugin is None:
            logger.warning("KV transport plugin %r left out: %s", record.name, record.error)
    named = plugins.named(KV_TRANSPORT, "tokenmill_kv_transports", _check_factory)
    return {name: factory for name, (_, factory) in named.items()}


def resolve_transport_name(name: str | None) -> str:
    """`name` if installed; None: the first of PREFERENCE installed. Raises ValueError
    naming what is installed otherwise."""
    found = available_transports()
    if name is None:
        name = next((n for n in PREFERENCE if n in found), None)
        if name is None:
            raise ValueError("prefill/decode disaggregation needs a KV transport; none is "
                             "installed: pip install 'plugins/kv_nixl[nixl]' (NIXL) or "
                             "'plugins/kv_mooncake[store]' (Mooncake's transfer engine)")
        return name
    if name not in found:
        raise ValueError(f"kv_transport={name!r} is not installed; installed: {sorted(found)}")
    return name


def make_transport(name: str, context: TransportContext) -> KVTransport:
    """Build transport `name` (raises ValueError naming what is installed)."""
    factory = available_transports().get(name)
    if factory is None:
        raise ValueError(f"kv_transport={name!r} is not installed; installed: "
                         f"{sorted(available_transports())}")
    transport = factory(context)
    if not isinstance(transport, KVTransport):
        raise TransportError(f"KV transport {name!r} built {type(transport).__name__}, not a "
                             "tokenmill.platforms.kv_transport.KVTransport")
    return transport
