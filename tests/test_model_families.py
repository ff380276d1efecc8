"""Model families are found, never listed: each is one module of
`tokenmill.model.families` with its `FAMILY` descriptor, and no generic file of the core
names one. Each family's tiny-config rule, applied to transformers' default (full-size)
config of the family, gives a model whose greedy tokens equal transformers'.

(A family from outside the core, registered through an entry point and served with
TP2 x PP2, is tests/test_family_plugin.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from tiny_models import hf_greedy, save_random_model
from transformers import AutoConfig

from tokenmill import LLM, SamplingParams
from tokenmill.model.family import ModelFamily, keep_kinds
from tokenmill.model.registry import builtin_families, families, family_for
from tokenmill_conformance.tiny_models import make_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FAMILIES_DIR = ROOT / "core" / "model" / "families"
# the engine and the contract: what is not a family module must not name one (the
# server's parsers are named after model families' output formats, not families)
GENERIC_DIRS = [ROOT / "core", ROOT / "platforms"]


def _family_module_files() -> set[str]:
    return {p.stem for p in FAMILIES_DIR.glob("*.py") if p.stem != "__init__"}


def test_every_family_module_is_found_and_every_type_has_one_family():
    found = builtin_families()
    assert {f.model.__module__.rpartition(".")[2] for f in found} == _family_module_files()
    by_type = families()
    for family in found:
        assert isinstance(family, ModelFamily)
        for model_type in family.model_types:
            assert by_type[model_type] is family
    assert len(by_type) == sum(len(f.model_types) for f in found)


def _names_in(path: Path, words: set[str], root: Path = ROOT) -> list[str]:
    """Where `path` names one of `words` as a string constant, or imports a family module."""
    hits = []
    tree = ast.parse(path.read_text(), str(path))
    # an f-string's literal pieces build names (a path), they list nothing
    pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if id(node) in pieces:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words:
            hits.append(f"{path.relative_to(root)}:{node.lineno} names {node.value!r}")
        if isinstance(node, ast.ImportFrom) and node.module:
            imported = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            hits += [
                f"{path.relative_to(root)}:{node.lineno} imports {name}" for name in imported
                if name.startswith("tokenmill.model.families.")
            ]
        if isinstance(node, ast.Import):
            hits += [
                f"{path.relative_to(root)}:{node.lineno} imports {a.name}" for a in node.names
                if a.name.startswith("tokenmill.model.families.")
            ]
    return hits


def test_no_generic_core_file_names_a_family():
    """Adding a family touches its own module only: no file of the core outside
    core/model/families/ names a family's model_type or name, or imports its module."""
    words = {t for f in builtin_families() for t in (f.name, *f.model_types)}
    assert {"llama", "qwen3_next", "bamba", "gemma3_text"} <= words
    files = [p for d in GENERIC_DIRS for p in d.rglob("*.py") if FAMILIES_DIR not in p.parents]
    assert len(files) > 50
    hits = [hit for p in files for hit in _names_in(p, words)]
    assert hits == []


def test_the_scan_would_see_a_family_named_in_a_generic_file(tmp_path):
    """The check above fails where it should: a registry-style list and an import."""
    planted = tmp_path / "core" / "registry.py"
    planted.parent.mkdir()
    planted.write_text('from tokenmill.model.families.bamba import FAMILY\nTYPES = ("qwen3_next",)\n')
    hits = _names_in(planted, {"qwen3_next"}, root=tmp_path)
    assert len(hits) == 3, hits  # the module, the name imported from it, the string


def test_keep_kinds_keeps_every_kind():
    assert keep_kinds(["a"] * 5 + ["b"], 2) == ["a", "b"]
    assert keep_kinds(["a", "a", "b", "c"], 3) == ["a", "c", "b"]
    assert keep_kinds(["a", "b", "a", "b"], 4) == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="2 layers cannot hold the 3 layer kinds"):
        keep_kinds(["a", "b", "c"], 2)


def test_an_unknown_model_type_names_the_supported_ones():
    config = AutoConfig.for_model("granite")
    with pytest.raises(ValueError, match=r"model_type 'granite' .* supported model types: \["):
        family_for(config)


PROMPT = "The quick brown fox jumps"
NEW_TOKENS = 5


def _tiny_from_default(family: ModelFamily, model_type: str, path: Path) -> Path:
    """transformers' default config of `model_type`, shrunk by the family's rule, saved
    with random weights and a tokenizer."""
    tokenizer = make_tokenizer(300)
    ids = dict(vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=None, eos_token_id=2)
    config = family.tiny(AutoConfig.for_model(model_type, **ids))
    assert config.model_type == model_type and config.num_hidden_layers <= 4
    return save_random_model(config, tokenizer, path)


@pytest.mark.parametrize("family", builtin_families(), ids=lambda f: f.name)
def test_tiny_rule_of_every_family_serves_like_transformers(family, tmp_path):
    model_type = family.model_types[-1]  # llama's last is qwen3: q/k norm and head_dim
    path = _tiny_from_default(family, model_type, tmp_path / model_type)
    llm = LLM(str(path), dtype="float32", block_size=4, platform="cpu",
              kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False)
    try:
        prompt_ids = llm.get_tokenizer()(PROMPT)["input_ids"]
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert out[0].outputs[0].token_ids == hf_greedy(path, prompt_ids, NEW_TOKENS)
