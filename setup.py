"""Packages are found, never listed: every folder with an `__init__.py` under core/,
platforms/ and server/ ships, under the import name pyproject.toml's package-dir maps its
root to (core/ -> tokenmill, platforms/ -> tokenmill.platforms, server/ -> tokenmill.server).
tests/test_packaging.py builds the wheel and compares its files with the source tree."""

from setuptools import find_packages, setup

ROOTS = {"tokenmill": "core", "tokenmill.platforms": "platforms", "tokenmill.server": "server"}


def found_packages() -> list[str]:
    return [name for prefix, folder in ROOTS.items()
            for name in (prefix, *(f"{prefix}.{sub}" for sub in find_packages(folder)))]


setup(packages=found_packages())
