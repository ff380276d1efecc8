"""The vendor guide's reference parts, rendered from the contract's own code: the classes a
vendor implements, the data that crosses the seam (with each field's comment), the KV
page layout, the plugin kinds, and every public name of `tokenmill.platforms`.

Rendered, not written, so they cannot drift: tests/test_contract_docs.py fails when a
public name of the contract has no docstring or is missing from docs/vendor-guide.md.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import textwrap

import tokenmill.platforms as contract
from tokenmill.platforms import interfaces, model_runner
from tokenmill.platforms.plugins import KINDS

# what a vendor implements, in the order the guide explains them
IMPLEMENTED = (
    interfaces.AttentionBackend, interfaces.LinearAttentionBackend, interfaces.Allocator,
    interfaces.Communicator, model_runner.ModelRunnerBase, model_runner.GraphCapture,
)
# the data a plugin reads or returns at the seam, fields listed with their comments
SEAM_DATA = (
    interfaces.AttentionMetadata, interfaces.AttentionSpec, interfaces.Capabilities,
    interfaces.Platform, model_runner.ModelRunnerContext, model_runner.KVCacheSpec,
    model_runner.ParallelConfig, model_runner.RunnerCapabilities, model_runner.KVCacheLayout,
    model_runner.KVCachePages,
)
SKIPPED_MODULES = ("tokenmill.platforms.template",)  # the skeleton's text, not API

LAYOUT = """\
## The KV page layout

The worker owns one KV arena of bytes (from the platform's `KV_ARENA` allocator) and
carves it into pages: `num_slots` regions (layer slots), each of `num_blocks` pages of
`page_bytes`. The core groups layers by attention type (`KVCacheSpec.layer_groups`: each
group has its own block table per request, `NewRequest.block_ids` for group 0 and
`extra_block_ids[g - 1]` for group g) and gives each layer a slot
(`KVCacheSpec.layer_slots`); a block id names one page in every slot, so groups of
different types draw from one free list without overlapping.

- A full or sliding-window attention layer's pages are `interfaces.kv_cache_shape(spec,
  num_blocks)` = `[2, num_blocks, block_size, num_kv_heads, head_size]` in the layer's
  dtype: keys at `[0, b]`, values at `[1, b]`. A token at position p of a sequence lives
  in page `table[p // block_size]`, row `p % block_size`.
- An MLA layer's pages are `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`:
  one latent row per token, block-major (`MLADims`).
- A LINEAR (recurrent) layer sees its slot as bytes, uint8 `[2, num_blocks, page_bytes //
  2]`; one sequence's state (`RecurrentStateSpec`: its tensors, packed at `offsets`)
  spans `pages_for(spec, page_bytes)` pages, listed in the group's block table: page j
  contributes its first half then its second. `tokenmill.platforms.kit.kv_state`
  (`read_states`, `write_states`, `zero_states`) reads and writes them. Prefix-cache
  checkpoints are states of the same size in other pages
  (`StepDescription.recurrent_state`).
- A backend may declare another view of the same bytes (`AttentionBackend.
  kv_cache_shape`); the arena views that layer's pages so. A model runner declares the
  pages it needs (`KVCacheLayout`) and gets views of them (`KVCachePages`); it must keep
  block b's KV in page b, so that prefix caching, KV offload (which copies whole pages
  between the arena and the tiers) and sleep mode work for it as for the core's runner.
- Pages are not zeroed: unwritten rows may hold anything, NaN included; a kernel must
  mask them out of every result (conformance tier T1 fills caches with NaN).
"""


def _methods(cls: type) -> list[tuple[str, object]]:
    """The methods `cls` defines itself, in source order."""
    own = [(n, f) for n, f in vars(cls).items()
           if inspect.isfunction(f) and (not n.startswith("_") or n == "__call__")]
    return sorted(own, key=lambda item: inspect.getsourcelines(item[1])[1])


def _first_paragraph(doc: str | None) -> str:
    text = inspect.cleandoc(doc or "").split("\n\n", 1)[0]
    return " ".join(text.split())


def render_implemented() -> str:
    lines = ["## The classes you implement", ""]
    for cls in IMPLEMENTED:
        base = ", ".join(b.__name__ for b in cls.__bases__ if b is not object)
        lines += [f"### `{cls.__name__}`" + (f" ({base})" if base != "ABC" else ""), "",
                  inspect.cleandoc(cls.__doc__ or ""), ""]
        for name, function in _methods(cls):
            abstract = getattr(function, "__isabstractmethod__", False)
            signature = str(inspect.signature(function)).replace("'", "")
            lines += [f"- `{name}{signature}`" + (" (abstract)" if abstract else "") + ": "
                      + " ".join(inspect.cleandoc(function.__doc__ or "").split())]
        annotated = dict(inspect.get_annotations(cls))
        for name, value in list(vars(cls).items()):
            if not name.startswith("_") and not callable(value) and name in annotated:
                lines.append(f"- attribute `{name}` = `{value!r}`")
        lines.append("")
    return "\n".join(lines)


def _field_comments(cls: type) -> dict[str, str]:
    """`name: type  # comment` (and comment lines just above a field) from `cls`'s source."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            row = lines[node.lineno - 1]
            above, k = [], node.lineno - 2
            while k >= 0 and lines[k].strip().startswith("#"):
                above.insert(0, lines[k].strip().lstrip("# "))
                k -= 1
            inline = row.split("#", 1)[1].strip() if "#" in row else ""
            comments[node.target.id] = " ".join([*above, inline]).strip()
    return comments


def render_seam_data() -> str:
    lines = ["## The data at the seam", ""]
    for cls in SEAM_DATA:
        lines += [f"### `{cls.__name__}`", "", _first_paragraph(cls.__doc__), "",
                  "| field | type | meaning |", "|---|---|---|"]
        comments = _field_comments(cls)
        for field in dataclasses.fields(cls):
            kind = str(field.type).replace("|", "or")
            lines.append(f"| `{field.name}` | `{kind}` | {comments.get(field.name, '')} |")
        lines.append("")
    return "\n".join(lines)


def render_kinds() -> str:
    lines = ["## Plugin kinds", "",
             "One plugin manager (`tokenmill.platforms.plugins.PluginManager`) loads every "
             "kind through its entry point group and validates each plugin the same way "
             "(hook names of its kind, `@hookimpl`, signatures, required hooks, the declared "
             "API version against every part it uses); `tokenmill plugins` lists them all.",
             "", "| kind | entry point group | hooks | for |", "|---|---|---|---|"]
    for kind in KINDS:
        hooks = ", ".join(f"`{h}`" for h in sorted(kind.hooks))
        lines.append(f"| {kind.name} | `{kind.entry_point_group}` | {hooks} | {kind.summary} |")
    return "\n".join(lines) + "\n"


def public_names() -> dict[str, list[tuple[str, object]]]:
    """Module -> its public classes and functions (defined there, not imported), for every
    module of `tokenmill.platforms` but the skeleton's text."""
    out: dict[str, list[tuple[str, object]]] = {}
    for info in sorted(pkgutil.walk_packages(contract.__path__, "tokenmill.platforms."),
                       key=lambda i: i.name):
        if info.name in SKIPPED_MODULES:
            continue
        module = importlib.import_module(info.name)
        names = [(n, obj) for n, obj in vars(module).items()
                 if not n.startswith("_") and getattr(obj, "__module__", None) == info.name
                 and (inspect.isclass(obj) or inspect.isfunction(obj))]
        out[info.name] = sorted(names, key=lambda item: item[0])
    return out


def render_reference() -> str:
    lines = ["## Reference: every public name of `tokenmill.platforms`", "",
             "What a plugin may import. Anything else of `tokenmill` is the core's and may "
             "change without notice (tests/test_contract_imports.py keeps the plugins here "
             "to this list).", ""]
    for module, names in public_names().items():
        summary = _first_paragraph(importlib.import_module(module).__doc__)
        lines += [f"### `{module}`", "", summary, ""]
        for name, obj in names:
            kind = "class" if inspect.isclass(obj) else "function"
            lines.append(f"- {kind} `{name}`: {_first_paragraph(obj.__doc__)}")
        lines.append("")
    return "\n".join(lines)


def render_all() -> str:
    return "\n".join([render_kinds(), render_implemented(), render_seam_data(), LAYOUT,
                      render_reference()])
