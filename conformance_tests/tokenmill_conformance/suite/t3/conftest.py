"""Fixtures of tier T3, shared by its modules: the tiny models and the reference
platform's greedy tokens, built once per run of the tier."""

from __future__ import annotations

import pytest

from tokenmill_conformance.session import REFERENCE_NAME
from tokenmill_conformance.suite.t3.common import ARCHS, engine_settings, greedy_tokens
from tokenmill_conformance.tiny_models import make_tiny_model


@pytest.fixture(scope="package")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="package")
def reference_tokens(conformance, active, tiny_dirs):
    """The reference platform's greedy tokens per architecture, computed once."""
    cache: dict[str, list[list[int]]] = {}

    def tokens(arch: str) -> list[list[int]]:
        if arch not in cache:
            settings = engine_settings(active)
            cache[arch] = greedy_tokens(conformance, tiny_dirs[arch], REFERENCE_NAME, **settings)
        return cache[arch]

    return tokens
