"""Which tool-call format a chat template writes, for `--enable-auto-tool-choice` without
`--tool-call-parser`."""

from __future__ import annotations

from tokenmill.frontend.tokenizing import template_reads_tools

# (parser, what in the template shows it), most specific first: Qwen3-Coder's template
# also writes <tool_call>.
_SIGNS = (
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>",)),
)


def detect_tool_parser(template: str | None) -> tuple[str | None, str]:
    """(parser name, why), or (None, why) when the template shows no one format clearly."""
    if not template:
        return None, "the model has no chat template"
    if not template_reads_tools(template):
        return "hermes", ("the chat template does not read `tools`, so the server writes them "
                          "in the Hermes <tool_call> layout")
    found = [(name, signs) for name, signs in _SIGNS if all(s in template for s in signs)]
    if found and found[0][0] == "qwen3_coder":
        found = found[:1]
    if len(found) == 1:
        name, signs = found[0]
        return name, f"the chat template writes {' and '.join(signs)}"
    if not found:
        return None, "the chat template shows none of the known tool-call formats"
    return None, f"the chat template shows several formats: {[n for n, _ in found]}"
