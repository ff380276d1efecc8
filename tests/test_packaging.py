"""The wheels ship the source tree: each distribution is built from a clean copy of its
folder (as pip builds it for a user) and its wheel's files are compared with the folders
it packages. Editable installs, which every other test uses, hide a package left out of a
wheel; this test does not."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The core distribution's folders and the import paths pyproject.toml's package-dir gives them.
CORE_ROOTS = {"core": "tokenmill", "platforms": "tokenmill/platforms", "server": "tokenmill/server"}
NOT_SOURCE = ("__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".venv*", ".git",
              ".hypothesis", ".pytest_cache", ".ruff_cache")


def _dists() -> list[Path]:
    """The core, every plugin under plugins/ and the conformance suite: each folder that
    holds a pyproject.toml."""
    return [ROOT, *sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml")),
            ROOT / "conformance_tests"]


def _package_roots(dist: Path) -> dict[Path, str]:
    """Source folder -> the path its files take in the wheel."""
    if dist == ROOT:
        return {ROOT / folder: target for folder, target in CORE_ROOTS.items()}
    return {p.parent: p.parent.name for p in dist.glob("tokenmill_*/__init__.py")}


def _source_files(folder: Path, target: str) -> set[str]:
    out = set()
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if path.is_dir() or any(part == "__pycache__" for part in rel.parts):
            continue
        if path.suffix == ".pyc":
            continue
        out.add(f"{target}/{rel.as_posix()}")
    return out


def _build_wheel(dist: Path, tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(dist, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    out = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(out), str(src)],
                   check=True, cwd=tmp_path, capture_output=True, text=True)
    (wheel,) = out.glob("*.whl")
    return wheel


def _label(dist: Path) -> str:
    return "core" if dist == ROOT else dist.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("dist", _dists(), ids=_label)
def test_wheel_ships_every_source_file(dist, tmp_path):
    roots = _package_roots(dist)
    assert roots, f"{dist} packages no tokenmill_* folder"
    expected = set().union(*(_source_files(folder, target) for folder, target in roots.items()))
    with zipfile.ZipFile(_build_wheel(dist, tmp_path)) as wheel:
        names = wheel.namelist()
        entry_points = "".join(wheel.read(n).decode() for n in names
                               if n.endswith(".dist-info/entry_points.txt"))
    shipped = {n for n in names if ".dist-info/" not in n}
    missing = sorted(expected - shipped)
    assert not missing, (f"the wheel of {_label(dist)} leaves out {missing}: a folder without "
                         "__init__.py, or a data file that package-data does not name")
    assert not sorted(shipped - expected), f"the wheel of {_label(dist)} ships files the tree lacks"
    if dist == ROOT:
        assert "tokenmill = tokenmill.server.cli:main" in entry_points
    elif (dist / f"tokenmill_{dist.name}" / "plugin.py").is_file():
        assert f"{dist.name} = tokenmill_{dist.name}.plugin" in entry_points
