"""tokenmill: a hardware-neutral LLM inference engine.

The names below are the user's API (and what the conformance suite's end-to-end tiers
drive); a platform plugin imports `tokenmill.platforms` only.
"""

from tokenmill.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured import StructuredOutputError, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "AsyncLLM", "EngineArgs", "SamplingParams", "StructuredOutputsParams",
    "StructuredOutputError", "RequestOutput", "CompletionOutput", "Logprob",
    "supported_model_types", "__version__",
]


def __getattr__(name: str):
    # these pull in torch and the model code; keep `import tokenmill` light
    if name == "LLM":
        from tokenmill.frontend.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from tokenmill.frontend.async_engine import AsyncLLM

        return AsyncLLM
    if name == "EngineArgs":
        from tokenmill.engine.config import EngineArgs

        return EngineArgs
    if name == "supported_model_types":
        from tokenmill.model.registry import supported_model_types

        return supported_model_types
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
