"""T1 collectives: every communicator method in real 2- and 4-process groups, every dtype."""

from __future__ import annotations

import pytest

from tokenmill_conformance.collectives_harness import COLLECTIVES, check_result, run_group
from tokenmill_conformance.suite.conftest import capabilities_of

WORLD_SIZES = (2, 4)


def _dtypes(caps) -> list[str]:
    return sorted(str(d).removeprefix("torch.") for d in caps.dtypes)


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
def group_results(conformance, active):
    """Runs each world size's group once; tests read their check from the results."""
    cache: dict[int, dict] = {}

    def results(world: int) -> dict:
        if world not in cache:
            dtypes = _dtypes(active.platform.capabilities)
            cache[world] = run_group(conformance.source, world, dtypes)
        return cache[world]

    return results


def test_collective(group_results, collective_case):
    world, collective, dtype = collective_case
    results = group_results(world)
    check_result(results, f"{collective}-{dtype}", world, pytest.fail)


def test_collectives_not_declared(active):
    if active.platform.capabilities.collectives:
        pytest.skip("collectives are declared: see test_collective")
    assert not active.platform.capabilities.collectives
