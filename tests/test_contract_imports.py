"""The contract is the whole vendor-facing API: an import lint.

- `tokenmill.platforms` imports nothing else of tokenmill (it is what a vendor builds
  against, so a refactor of the core cannot break a plugin through it);
- every plugin under plugins/ and the conformance suite import `tokenmill.platforms` and
  nothing else of the core, except the user's API: the public names of the `tokenmill`
  root (`tokenmill.__all__`: LLM, AsyncLLM, EngineArgs, SamplingParams, ...) and of
  `tokenmill.server` (`build_app`), which the end-to-end tiers and hardware scripts drive
  as any user does;
- so does the plugin `tokenmill new-plugin` writes.

Imports are read from the syntax tree (inside functions too), with `importlib.
import_module("tokenmill....")` string arguments.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import tokenmill
import tokenmill.server
from tokenmill.platforms.template import write_plugin

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = "tokenmill.platforms"
PUBLIC = {"tokenmill": set(tokenmill.__all__), "tokenmill.server": set(tokenmill.server.__all__)}


def _in_contract(module: str) -> bool:
    return module == CONTRACT or module.startswith(CONTRACT + ".")


def _imports(path: Path) -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """(line, module, names) for every tokenmill import in `path`; names empty for
    `import module` (and for `import_module("module")`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tokenmill":
                    yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "tokenmill":
                yield node.lineno, node.module, tuple(a.name for a in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and str(node.args[0].value).split(".")[0] == "tokenmill"):
            yield node.lineno, str(node.args[0].value), ()


def _attribute_uses(path: Path, name: str) -> Iterator[tuple[int, str]]:
    """`tokenmill.X` attribute reads in a file that did `import tokenmill`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == name):
            yield node.lineno, node.attr


def _violations(path: Path, allow_public: bool) -> list[str]:
    found = []
    for line, module, names in _imports(path):
        if _in_contract(module):
            continue
        public = PUBLIC.get(module) if allow_public else None
        if public is not None and names:
            bad = [n for n in names if n not in public and not _in_contract(f"{module}.{n}")]
            if not bad:
                continue
            found.append(f"{path.relative_to(ROOT)}:{line}: from {module} import {bad}")
        elif public is not None and module == "tokenmill":  # `import tokenmill`
            bad = sorted({a for _, a in _attribute_uses(path, "tokenmill")} - public - {"platforms"})
            if bad:
                found.append(f"{path.relative_to(ROOT)}:{line}: tokenmill.{bad} (not public)")
        else:
            found.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    return found


def _python_files(*folders: str) -> list[Path]:
    files = [p for f in folders for p in sorted((ROOT / f).rglob("*.py"))]
    assert files, f"no Python files under {folders}"
    return files


def test_the_contract_imports_nothing_else_of_the_core():
    bad = [v for p in _python_files("platforms") for v in _violations(p, allow_public=False)]
    assert not bad, "tokenmill.platforms imports the core outside the contract:\n" + "\n".join(bad)


@pytest.mark.parametrize("folder", ["plugins", "conformance_tests"])
def test_plugins_and_the_conformance_suite_import_only_the_contract(folder):
    bad = [v for p in _python_files(folder) for v in _violations(p, allow_public=True)]
    assert not bad, (
        f"{folder} imports tokenmill modules outside tokenmill.platforms (move what they need "
        "into the contract's kit, or use the public tokenmill API):\n" + "\n".join(bad)
    )


def test_a_generated_plugin_imports_only_the_contract(tmp_path):
    root = write_plugin("linted", tmp_path)
    bad = [v for p in sorted(root.rglob("*.py")) for v in _violations_at(p, tmp_path)]
    assert not bad, "the generated skeleton imports outside the contract:\n" + "\n".join(bad)


def _violations_at(path: Path, base: Path) -> list[str]:
    return [
        f"{path.relative_to(base)}:{line}: {module}"
        for line, module, _ in _imports(path)
        if not _in_contract(module)
    ]


def test_the_lint_catches_a_private_import(tmp_path, monkeypatch):
    """The lint itself: a core-internal import, a non-public root name and a string
    import are each reported; contract imports and public names are not."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import importlib\n"
        "from tokenmill.platforms.step import StepDescription\n"
        "from tokenmill import LLM, SamplingParams\n"
        "from tokenmill.platforms.kit import sampler\n"
        "from tokenmill.worker.runner import ModelRunner\n"
        "from tokenmill import frontend\n"
        "def f():\n"
        "    importlib.import_module('tokenmill.engine.scheduler')\n"
    )
    found = _violations(plugin, allow_public=True)
    assert [v.split(":")[1] for v in found] == ["5", "6", "8"], found
