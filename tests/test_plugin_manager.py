"""One plugin manager for every extension point: each kind's plugins are found through its
entry point group, validated the same way, and listed by `tokenmill plugins`; the core's
own tiers, parsers and model runner are plugins on the same groups."""

from __future__ import annotations

import json

import pluggy
import pytest

from tokenmill.platforms.plugins import (
    KINDS,
    KV_TIER,
    KV_TRANSPORT,
    MODEL_RUNNER,
    PLATFORM,
    REASONING_PARSER,
    TOOL_PARSER,
    PluginError,
    PluginManager,
)
from tokenmill.server.cli import main

hookimpl = pluggy.HookimplMarker("tokenmill")


class TierPlugin:
    def __init__(self, api: str = "1.6") -> None:
        self.api = api

    @hookimpl
    def tokenmill_api_version(self):
        return self.api

    @hookimpl
    def tokenmill_kv_tiers(self):
        return {"mine": lambda options, context: None}


def test_the_core_s_own_plugins_are_found_like_any_other():
    plugins = PluginManager.discover()
    names = {kind.name: [r.name for r in plugins.records(kind)] for kind in KINDS}
    for kind in (KV_TIER, TOOL_PARSER, REASONING_PARSER, MODEL_RUNNER):
        record = plugins.record(kind, "tokenmill")
        assert record is not None and record.plugin is not None, (kind.name, names)
        assert record.distribution == "tokenmill" and record.api_version == "1.6"
    assert "mooncake" in names["kv_tier"] and "cpu" in names["platform"]
    assert "mooncake" in names["kv_transport"]


def test_tokenmill_plugins_lists_every_kind(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by = {(r["kind"], r["name"]): r for r in rows}
    assert by[("kv_tier", "tokenmill")]["detail"] == "disk, host, redis, rediss, valkey"
    assert "hermes" in by[("tool_parser", "tokenmill")]["detail"]
    assert by[("reasoning_parser", "tokenmill")]["detail"] == "deepseek_r1, qwen3"
    assert by[("model_runner", "tokenmill")]["ok"]
    assert by[("kv_transport", "mooncake")]["detail"] == "mooncake"
    assert by[("platform", "cpu")]["api_version"] and by[("platform", "cpu")]["ok"]
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "kv_tier (tokenmill.kv_tiers)" in text and "mooncake: tokenmill-kv-mooncake" in text


def test_every_kind_is_validated_the_same_way():
    plugins = PluginManager()
    plugins.register(TierPlugin(), KV_TIER, "mine")
    assert plugins.caller(KV_TIER, "mine")("tokenmill_kv_tiers").keys() == {"mine"}

    class PlatformHookOnATier(TierPlugin):
        @hookimpl
        def tokenmill_detect(self):
            return None

    with pytest.raises(PluginError, match="kv_tier plugin 'odd' defines 'tokenmill_detect', "
                                          "which is not a kv_tier hook"):
        PluginManager().register(PlatformHookOnATier(), KV_TIER, "odd")
    with pytest.raises(PluginError, match="kv_tier plugin 'old' declares plugin API 1.5 but uses "
                                          "hook tokenmill_kv_tiers, introduced in 1.6"):
        PluginManager().register(TierPlugin("1.5"), KV_TIER, "old")

    class Unversioned:
        @hookimpl
        def tokenmill_tool_parsers(self):
            return {}

    with pytest.raises(PluginError, match=r"tool_parser plugin 'nover' does not implement the "
                                          r"required hooks \['tokenmill_api_version'\]"):
        PluginManager().register(Unversioned(), TOOL_PARSER, "nover")

    kept = PluginManager()
    kept.register(TierPlugin("1.5"), KV_TIER, "old", keep_errors=True)
    (record,) = kept.records(KV_TIER)
    assert record.plugin is None and "introduced in 1.6" in record.error
    with pytest.raises(PluginError, match="kv_tier plugin 'old' is broken"):
        kept.caller(KV_TIER, "old")
    assert kept.named(KV_TIER, "tokenmill_kv_tiers", lambda n, f: None) == {}


def test_a_kind_s_plugins_may_not_share_a_name_but_kinds_may():
    plugins = PluginManager()
    plugins.register(TierPlugin(), KV_TIER, "tokenmill")
    with pytest.raises(PluginError, match="two kv_tier plugins are named 'tokenmill'"):
        plugins.register(TierPlugin(), KV_TIER, "tokenmill")

    class Parsers:
        @hookimpl
        def tokenmill_api_version(self):
            return "1.6"

        @hookimpl
        def tokenmill_reasoning_parsers(self):
            return {}

    plugins.register(Parsers(), REASONING_PARSER, "tokenmill")
    assert [r.name for r in plugins.records(REASONING_PARSER)] == ["tokenmill"]
    assert plugins.records(PLATFORM) == []


class TransportPlugin:
    def __init__(self, api: str = "1.6", items: dict | None = None) -> None:
        self.api = api
        self.items = items if items is not None else {"fabric": lambda context: None}

    @hookimpl
    def tokenmill_api_version(self):
        return self.api

    @hookimpl
    def tokenmill_kv_transports(self):
        return self.items


def test_kv_transports_come_through_the_manager():
    """P/D disaggregation asks the manager for its transports: validated and versioned
    like every kind, a bad factory named with its plugin."""
    from tokenmill.kv_connector.handover.transports import available_transports

    plugins = PluginManager()
    plugins.register(TransportPlugin(), KV_TRANSPORT, "fabric")
    assert list(available_transports(plugins)) == ["fabric"]
    with pytest.raises(PluginError, match="kv_transport plugin 'old' declares plugin API 1.5 "
                                          "but uses hook tokenmill_kv_transports, introduced "
                                          "in 1.6"):
        PluginManager().register(TransportPlugin("1.5"), KV_TRANSPORT, "old")
    bad = PluginManager()
    bad.register(TransportPlugin(items={"fabric": 3}), KV_TRANSPORT, "odd")
    with pytest.raises(PluginError, match="kv_transport plugin 'odd': tokenmill_kv_transports "
                                          "item 'fabric' is 3, not a factory function"):
        available_transports(bad)
