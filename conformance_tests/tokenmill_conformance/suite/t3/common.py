"""What the T3 tests share: prompts, architectures, engine settings, comparisons."""

from __future__ import annotations

import torch

from tokenmill.model.registry import supported_model_types
from tokenmill.sampling_params import SamplingParams
from tokenmill_conformance.tiny_models import VARIANTS

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "héllo wörld, naïve café, 你好世界 🙂 and then some more words to make this one long",
    "def main():",
]
ARCHS = [variant for t in supported_model_types() for variant in VARIANTS.get(t, ())]
UNCOVERED = [t for t in supported_model_types() if t not in VARIANTS]


def engine_settings(active) -> dict:
    caps = active.platform.capabilities
    dtype = torch.float32 if torch.float32 in caps.dtypes else active.platform.default_dtype
    block = min(caps.block_sizes, key=lambda s: abs(s - 4))
    # a small KV pool: a default one sized from memory would hold millions of tiny blocks;
    # 1,024 so that a hybrid's recurrent states (each spans many pages of 4-token blocks)
    # leave every prompt room to generate
    return {"dtype": str(dtype).removeprefix("torch."), "block_size": block, "num_kv_blocks": 1024}


def greedy_tokens(conformance, path, platform: str, max_tokens: int = 8, **engine_args):
    from tokenmill import LLM

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(str(path), platform=platform, registry=conformance.registry, **engine_args)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def compare(got: list[list[int]], expected: list[list[int]]) -> None:
    for prompt, g, e in zip(PROMPTS, got, expected):
        assert g == e, f"prompt {prompt!r}: plugin {g} != reference {e}"


