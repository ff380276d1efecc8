"""docs/vendor-guide.md is generated from the hookspec docstrings and must be current."""

from __future__ import annotations

from pathlib import Path

from tokenmill.platforms import hookspecs
from tokenmill_conformance import vendor_guide

GUIDE = Path(__file__).parents[2] / "docs" / "vendor-guide.md"


def test_vendor_guide_is_current():
    assert GUIDE.read_text() == vendor_guide.render(), (
        "docs/vendor-guide.md is stale; regenerate it with "
        "`python -m tokenmill_conformance.vendor_guide --write docs/vendor-guide.md`"
    )


def test_every_hook_is_in_the_guide_in_the_same_shape():
    text = GUIDE.read_text()
    for spec in vendor_guide.hook_specs():
        section = text.split(f"### `{spec.__name__}`", 1)[1].split("\n### ", 1)[0]
        for title in ("**When called**", "**Arguments**", "**Returns**", "**Core checks**",
                      "**Example**", f"def {spec.__name__}("):
            assert title in section, f"{spec.__name__}: {title} missing from the guide"
    assert len(vendor_guide.hook_specs()) >= len(hookspecs.REQUIRED_HOOKS)
