"""The docs hold for every reader: they list every metric the server exports (and none it
does not), and they name no folder of one machine."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.frontend.async_engine import EngineStats
from tokenmill.kv_connector.handover.messages import HandoverStats
from tokenmill.platforms.kv_tier import TierStats
from tokenmill.server.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# folders that exist on one machine only: a user's or this project's workplace
MACHINE_PATH = re.compile(r"(?<![\w.~])/(work|root|home|Users)/[\w.-]+|site-packages/")


def _exported() -> set[str]:
    """What a scrape of /metrics shows, as the docs name it (counters with `_total`), with
    every optional family present: KV offload tiers, the per-type KV split, P/D handovers."""
    metrics = Metrics("m")
    snapshot = EngineStats(kv_tiers={"host": TierStats()}, kv_blocks_by_type={"full": 1},
                           handover=HandoverStats())
    metrics.bind_engine(lambda: snapshot)
    names = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation time of each counter and histogram
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def _documented() -> set[str]:
    text = (ROOT / "docs" / "server.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(tokenmill:[a-z0-9_]+)", section))


def test_docs_list_every_metric_the_server_exports():
    exported, documented = _exported(), _documented()
    assert not exported - documented, f"exported, not in docs/server.md: {exported - documented}"
    assert not documented - exported, f"in docs/server.md, not exported: {documented - exported}"


def test_docs_name_no_folder_of_one_machine():
    found = [(doc.name, n, m.group(0)) for doc in DOCS
             for n, line in enumerate(doc.read_text().splitlines(), 1)
             for m in MACHINE_PATH.finditer(line)]
    assert not found, found
