"""Fixtures of the conformance suite; the run itself is set up by the pytest plugin."""

from __future__ import annotations

import pytest

from tokenmill.platforms.interfaces import Capabilities
from tokenmill.platforms.registry import ActivePlatform
from tokenmill_conformance.pytest_plugin import CONFORMANCE
from tokenmill_conformance.session import Conformance


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CONFORMANCE not in config.stash:
        raise pytest.UsageError(
            "the tokenmill conformance suite needs --tokenmill-platform NAME "
            "(or run `tokenmill-conformance --platform NAME`)"
        )


def conformance_of(config: pytest.Config) -> Conformance:
    return config.stash[CONFORMANCE]


def capabilities_of(config: pytest.Config) -> Capabilities | None:
    """The declared capabilities, to parametrize tests at collection; None if not loaded."""
    active = conformance_of(config).active
    return None if active is None else active.platform.capabilities


@pytest.fixture(scope="session")
def conformance(request: pytest.FixtureRequest) -> Conformance:
    return conformance_of(request.config)


@pytest.fixture(scope="session")
def active(conformance: Conformance) -> ActivePlatform:
    """The activated plugin under test; fails (not skips) when it did not load."""
    if conformance.active is None:
        pytest.fail(f"the platform did not load, see tier T0: {conformance.load_error}")
    return conformance.active


@pytest.fixture(scope="session")
def quick(conformance: Conformance) -> bool:
    return conformance.quick
