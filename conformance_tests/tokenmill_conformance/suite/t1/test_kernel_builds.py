"""T1 kernel builds: the plugin's kernels compiled ahead of time for every real target it
ships launch settings for (`tokenmill_kernel_builds`), on this machine, whether or not the
device is attached. A compile error or a register spill fails; every record (registers,
spills, shared memory per kernel and launch configuration) goes into the certificate's
`compile` section."""

from __future__ import annotations

import pytest

from tokenmill_conformance.compile_record import compile_section, problems


def test_kernels_compile_for_every_target_without_spills(conformance, active):
    builds = active.kernel_builds()
    if builds is None:
        pytest.skip("the plugin has no kernels of its own to compile (tokenmill_kernel_builds "
                    "is not implemented or returned None)")
    assert builds, "tokenmill_kernel_builds returned no build at all"
    conformance.compile_records = compile_section(builds)
    found = problems(builds)
    assert not found, (f"{len(found)} of {len(builds)} kernel builds failed or spill:\n"
                       + "\n".join(found[:40]))
