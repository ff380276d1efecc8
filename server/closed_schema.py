"""Closing a JSON schema's objects, so that JSON forced by it ends.

A schema object with `properties` but no `additionalProperties` allows any other key, and
constrained decoding then lets a small model add keys forever (SmolLM2-135M, asked for
`{"city": ...}`, went on with "country", "population", "weather", ... until max_tokens in
4 of 6 samples). Forced tool arguments are the tool's parameters and nothing else, and
OpenAI's strict schemas and Anthropic's output formats say the same
(`additionalProperties: false` on every object), so the server closes those schemas: every
object with `properties` and no `additionalProperties` gets `additionalProperties: false`
(xgrammar's "strict mode", vLLM's default). A schema that says otherwise is kept as given.
"""

from __future__ import annotations

from typing import Any

# keywords whose value is a schema, a list of schemas, or a map of name -> schema
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
        "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
MAX_DEPTH = 64


def close_objects(schema: Any, depth: int = 0) -> Any:
    """A copy of `schema` with every object that lists `properties` closed (see above);
    anything that is not a schema is returned as is. Nesting past MAX_DEPTH is left alone
    (the request's own depth limit refuses such bodies first)."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in (*_ONE, *_MANY):  # `items` may be a list too (draft 4's tuples)
        value = out.get(key)
        if isinstance(value, dict):
            out[key] = close_objects(value, depth + 1)
        elif isinstance(value, list):
            out[key] = [close_objects(s, depth + 1) for s in value]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: close_objects(s, depth + 1) for k, s in out[key].items()}
    return out
