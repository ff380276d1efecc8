import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny random models of every supported architecture, built once per session."""
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "llama3", "qwen2", "qwen3")}
