"""The contract is documented: every public name of `tokenmill.platforms` has a docstring
and a line in docs/vendor-guide.md's reference; every method of the classes a vendor
implements is described; every field of the data at the seam has its meaning; the guide
says how the KV pages are laid out and how to install and run the conformance tool.
(tests/conformance/test_vendor_guide.py checks that the committed guide is the one the
code renders.)"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from tokenmill_conformance import guide_reference

GUIDE = (Path(__file__).resolve().parents[1] / "docs" / "vendor-guide.md").read_text()
PUBLIC = [(m, n, obj) for m, names in guide_reference.public_names().items() for n, obj in names]


def _section(title: str) -> str:
    return GUIDE.split(title, 1)[1].split("\n## ", 1)[0]


def test_the_reference_covers_every_module_of_the_contract():
    modules = guide_reference.public_names()
    assert {"tokenmill.platforms.hookspecs", "tokenmill.platforms.interfaces",
            "tokenmill.platforms.step", "tokenmill.platforms.kit.sampler",
            "tokenmill.platforms.kit.runner_state", "tokenmill.platforms.ops.reference",
            "tokenmill.platforms.plugins"} <= set(modules)
    assert len(PUBLIC) > 150


@pytest.mark.parametrize("module,name,obj", PUBLIC, ids=[f"{m}.{n}" for m, n, _ in PUBLIC])
def test_every_public_name_is_documented(module, name, obj):
    assert (obj.__doc__ or "").strip(), f"{module}.{name} has no docstring"
    reference = _section(f"### `{module}`")
    assert f"`{name}`" in reference, f"{module}.{name} is not in docs/vendor-guide.md"


@pytest.mark.parametrize("cls", guide_reference.IMPLEMENTED, ids=lambda c: c.__name__)
def test_every_method_a_vendor_implements_is_described(cls):
    section = _section(f"### `{cls.__name__}`")
    for name, function in guide_reference._methods(cls):
        assert (function.__doc__ or "").strip(), f"{cls.__name__}.{name} has no docstring"
        assert f"`{name}(" in section, f"{cls.__name__}.{name} is not in the guide"


@pytest.mark.parametrize("cls", guide_reference.SEAM_DATA, ids=lambda c: c.__name__)
def test_every_field_at_the_seam_has_its_meaning(cls):
    comments = guide_reference._field_comments(cls)
    section = _section(f"### `{cls.__name__}`")
    for field in dataclasses.fields(cls):
        assert comments.get(field.name), f"{cls.__name__}.{field.name} has no comment"
        assert f"| `{field.name}` |" in section


def test_the_guide_explains_the_pages_and_the_tool():
    layout = _section("## The KV page layout")
    for needed in ("kv_cache_shape", "[2, num_blocks, block_size, num_kv_heads, head_size]",
                   "read_states", "KVCachePages", "layer_groups", "NaN"):
        assert needed in layout, needed
    start = _section("## Start from the template")
    assert "pip install -e <tokenmill>/conformance_tests" in start
    assert "tokenmill-conformance --platform myaccel" in start
    assert "tokenmill-conformance --platform NAME" in _section("## Certification")


def test_the_lint_of_the_docs_can_fail():
    """A name without a docstring is caught (the check itself, on a throwaway class)."""

    class Undocumented:
        pass

    assert not (Undocumented.__doc__ or "").strip()
    assert inspect.getdoc(Undocumented) is None
