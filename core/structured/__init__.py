"""Structured output: constrained decoding through llguidance, applied as a token mask.

`StructuredOutputsParams` says what the output must match; the engine's
`StructuredOutputManager` (tokenmill.structured.manager) compiles it, keeps one matcher
per sequence, fills each step's token bitmask and advances the matchers. This package's
top level stays light: it imports neither torch nor llguidance.
"""

from tokenmill.structured.params import StructuredOutputError, StructuredOutputsParams

__all__ = ["StructuredOutputError", "StructuredOutputsParams"]
