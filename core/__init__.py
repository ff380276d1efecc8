"""tokenmill: a hardware-neutral LLM inference engine."""

from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured import StructuredOutputError, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "StructuredOutputsParams", "StructuredOutputError",
    "RequestOutput", "CompletionOutput", "Logprob", "__version__",
]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; keep `import tokenmill` light.
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
