"""T1 collectives: every communicator method in real 2- and 4-rank process groups (a world
of 4 processes and a subgroup of 2), every declared dtype, several shapes."""

from __future__ import annotations

import pytest

from tokenmill_conformance.collectives_harness import COLLECTIVES, check_result, run_groups
from tokenmill_conformance.suite.conftest import capabilities_of

WORLD_SIZES = (2, 4)


def _dtypes(caps) -> list[str]:
    """Every declared dtype, and int64 (token ids are gathered across ranks)."""
    return sorted({str(d).removeprefix("torch.") for d in caps.dtypes} | {"int64"})


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "collective_case" not in metafunc.fixturenames:
        return
    caps = capabilities_of(metafunc.config)
    cases = []
    if caps is not None and caps.collectives:
        cases = [(w, c, d) for w in WORLD_SIZES for c in COLLECTIVES for d in _dtypes(caps)]
    metafunc.parametrize(
        "collective_case", cases, ids=[f"world{w}-{c}-{d}" for w, c, d in cases]
    )


@pytest.fixture(scope="module")
def group_results(conformance, active) -> dict:
    """One run of 4 processes: the world group, then a 2-rank subgroup; tests read their
    check from the results."""
    dtypes = _dtypes(active.platform.capabilities)
    return run_groups(conformance.source, list(WORLD_SIZES), dtypes)


def test_collective(group_results, collective_case):
    world, collective, dtype = collective_case
    check_result(group_results, f"world{world}-{collective}-{dtype}", pytest.fail)


def test_collectives_not_declared(active):
    if active.platform.capabilities.collectives:
        pytest.skip("collectives are declared: see test_collective")
    assert not active.platform.capabilities.collectives
