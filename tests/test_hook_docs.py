"""Every hook of the plugin API is documented in the same shape; an undocumented one fails."""

from __future__ import annotations

import inspect

import pytest

from tokenmill.platforms import hookspecs

SECTIONS = ("When called:", "Arguments:", "Returns:", "Core checks:", "Example:")


def hook_specs() -> list:
    return [
        function
        for _, function in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(function, f"{hookspecs.PROJECT_NAME}_spec")
    ]


def test_the_hookspec_module_declares_the_whole_api():
    names = {spec.__name__ for spec in hook_specs()}
    assert len(names) >= 11
    assert all(name.startswith("tokenmill_") for name in names)
    assert hookspecs.REQUIRED_HOOKS <= names
    undeclared = {
        name for name in dir(hookspecs) if name.startswith("tokenmill_") and name not in names
    }
    assert not undeclared, f"functions named like hooks but not marked @hookspec: {undeclared}"


@pytest.mark.parametrize("spec", hook_specs(), ids=lambda spec: spec.__name__)
def test_hook_docstring_has_every_section_in_order(spec):
    doc = inspect.getdoc(spec) or ""
    summary = doc.split("\n", 1)[0]
    assert summary.strip(), f"{spec.__name__} has no summary line"
    positions = [doc.find(section) for section in SECTIONS]
    missing = [section for section, at in zip(SECTIONS, positions, strict=True) if at < 0]
    assert not missing, f"{spec.__name__}'s docstring lacks {missing}"
    assert positions == sorted(positions), f"{spec.__name__}: sections out of order {SECTIONS}"
    example = doc[positions[-1] :]
    assert "@hookimpl" in example and f"def {spec.__name__}(" in example, (
        f"{spec.__name__}'s example must show a @hookimpl implementation of itself"
    )


@pytest.mark.parametrize("spec", hook_specs(), ids=lambda spec: spec.__name__)
def test_hook_arguments_are_each_described(spec):
    doc = inspect.getdoc(spec) or ""
    arguments = doc[doc.find("Arguments:") : doc.find("Returns:")]
    for name in inspect.signature(spec).parameters:
        assert f"{name}:" in arguments, f"{spec.__name__}: argument {name!r} is not described"
