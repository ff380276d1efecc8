"""The pytest plugin (entry point group `pytest11`): runs the suite against one platform.

Inert unless `--tokenmill-platform NAME` is given. Then it loads the plugin, selects
tiers, applies the plugin's waivers (never to core tiers), records every test's outcome
by tier and writes the certificate at the end of the session.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tokenmill_conformance.session import Conformance  # noqa: F401 - the stash's type

# Loaded by every pytest run in the environment: nothing heavy (torch, tokenmill) is
# imported unless a platform is being certified.
CONFORMANCE = pytest.StashKey["Conformance"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tokenmill", "tokenmill conformance (certify a platform plugin)")
    group.addoption("--tokenmill-platform", metavar="NAME", help="the platform to certify")
    group.addoption(
        "--tokenmill-plugin",
        metavar="SPEC",
        help="register the plugin in-process from 'pkg.module[:attr]' or 'file.py' "
        "instead of its installed entry point",
    )
    group.addoption("--tokenmill-tier", metavar="TIERS", help="run only these tiers: T1, T0-T3")
    group.addoption("--tokenmill-report", metavar="PATH", help="write the JSON certificate")
    group.addoption("--tokenmill-markdown", metavar="PATH", help="write the Markdown certificate")
    group.addoption(
        "--tokenmill-quick",
        action="store_true",
        help="smaller property-test and benchmark budgets (same tests)",
    )


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("--tokenmill-platform")
    if not name:
        return
    from tokenmill_conformance.certificate import Recorder
    from tokenmill_conformance.run import CertificationRun
    from tokenmill_conformance.session import Conformance, PluginSource
    from tokenmill_conformance.tiers import TIER_BY_ID, parse_tiers

    conformance = Conformance(
        PluginSource(name, config.getoption("--tokenmill-plugin")),
        quick=config.getoption("--tokenmill-quick"),
    )
    conformance.load()
    tiers_option = config.getoption("--tokenmill-tier")
    tiers = parse_tiers(tiers_option) if tiers_option else list(TIER_BY_ID)
    config.stash[CONFORMANCE] = conformance
    run = CertificationRun(conformance, Recorder(tiers=tiers, started=time.time()))
    config.pluginmanager.register(run, "tokenmill-conformance-run")
