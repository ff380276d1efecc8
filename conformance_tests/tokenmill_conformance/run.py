"""The hooks of one certification run, registered by the pytest plugin when a platform is
being certified: tier selection, waivers, outcome recording, the certificate."""

from __future__ import annotations

import pytest

from tokenmill.platforms.registry import PlatformError
from tokenmill_conformance.certificate import Recorder, Waiver, build_certificate, write
from tokenmill_conformance.session import Conformance
from tokenmill_conformance.tiers import TIER_BY_ID, suite_id, tier_of


class CertificationRun:
    """The per-run hooks, registered only when a platform is being certified."""

    def __init__(self, conformance: Conformance, recorder: Recorder) -> None:
        self.conformance = conformance
        self.recorder = recorder
        self.certificate: dict | None = None

    def pytest_collection_modifyitems(
        self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        selected, deselected = [], []
        for item in items:
            test_id = suite_id(item.path, item.nodeid)
            self.recorder.ids[item.nodeid] = test_id
            (selected if tier_of(test_id) in self.recorder.tiers else deselected).append(item)
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = selected
        self.recorder.waivers = _apply_waivers(self.conformance, items, self.recorder.ids)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.recorder.add_collection_error(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.recorder.add(report)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.certificate = build_certificate(self.conformance, self.recorder)
        config = session.config
        write(
            self.certificate,
            config.getoption("--tokenmill-report"),
            config.getoption("--tokenmill-markdown"),
        )

    def pytest_terminal_summary(self, terminalreporter, exitstatus: int) -> None:
        if self.certificate is None:
            return
        certificate = self.certificate
        terminalreporter.section("tokenmill conformance")
        for tier in certificate["tiers"]:
            terminalreporter.write_line(f"{tier['tier']} {tier['status']:>8}  {tier['title']}")
        for failure in certificate["failures"]:
            terminalreporter.write_line(f"FAILED [{failure['tier']}] {failure['id']}")
        terminalreporter.write_line(f"{certificate['plugin']['name']}: {certificate['verdict']}")


def _apply_waivers(
    conformance: Conformance, items: list[pytest.Item], ids: dict[str, str]
) -> list[Waiver]:
    """Marks waived tests xfail (non-strict: they still run); core tiers are not waivable."""
    if conformance.active is None:
        return []
    try:
        requested = conformance.active.waivers()
    except PlatformError as exc:  # reported by t0/test_contract.py::test_waivers_are_well_formed
        return [Waiver("<tokenmill_waivers>", str(exc), "rejected", "the hook failed")]
    waivers = []
    for test_id, reason in requested:
        # a waiver without [params] covers every parametrization of the test
        matched = [i for i in items if test_id in (ids[i.nodeid], ids[i.nodeid].split("[")[0])]
        if not matched:
            waivers.append(Waiver(test_id, reason, "unmatched", "no test has this id"))
            continue
        tier = TIER_BY_ID[tier_of(ids[matched[0].nodeid])]
        if not tier.waivable:
            note = f"{tier.id} is a core tier; its tests cannot be waived"
            waivers.append(Waiver(test_id, reason, "rejected", note))
            continue
        for item in matched:
            item.add_marker(pytest.mark.xfail(reason=f"waived: {reason}", strict=False))
        waivers.append(Waiver(test_id, reason, "applied", f"{len(matched)} test(s)"))
    return waivers
