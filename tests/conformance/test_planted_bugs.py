"""Tier T1 refuses each planted kernel bug of tests/conformance/planted_plugin.py in
bfloat16 (the plugin declares only bfloat16, as a vendor might), and every failure names
the op. The 1.01 scale is inside bfloat16's elementwise tolerance everywhere: only the
error statistics catch it."""

from __future__ import annotations

import pytest
from test_conformance import HERE, certify, tiers

pytestmark = pytest.mark.certify  # each a certification run in a subprocess: minutes

PLUGIN = HERE / "planted_plugin.py"
# bug -> (the T1 tests that run, what every failure message names)
CASES = {
    "scale": ("test_production_shapes", ["attention (", "scale error"]),
    "off_by_one_block": ("test_production_shapes", ["attention ("]),
    "wrong_window": ("test_production_shapes", ["attention (sliding_window"]),
    "wrong_gqa": ("test_production_shapes", ["attention ("]),
    "dropped_chunk_state": ("test_backends_match_the_reference and production",
                            ["linear attention (", "output"]),
}


@pytest.mark.parametrize("bug", sorted(CASES))
def test_planted_bug_fails_t1_naming_the_op(tmp_path, bug):
    selection, named = CASES[bug]
    code, output, cert, markdown = certify(
        tmp_path, "--platform", "planted", "--plugin", f"{PLUGIN}:{bug}", "--tier", "T1",
        "--", "-k", selection,
    )
    assert code == 1, output[-4000:]
    assert tiers(cert)["T1"] == "failed"
    assert cert["capabilities"]["dtypes"] == ["bfloat16"]
    failures = cert["failures"]
    assert failures, output[-4000:]
    for failure in failures:
        assert "bfloat16" in failure["message"], failure
        for words in named:
            assert words in failure["message"], (words, failure)
    assert "REFUSED: failing required tiers ['T1']" in output
