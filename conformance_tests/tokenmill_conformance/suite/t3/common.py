"""What the T3 tests share: prompts, architectures, engine settings, comparisons."""

from __future__ import annotations

import torch

from tokenmill import SamplingParams, supported_model_types
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


def greedy_tokens(conformance, path, platform: str, max_tokens: int = 8, keep: bool = False,
                  **engine_args):
    """Greedy token ids per prompt; with `keep`, (the ids, the LLM) to inspect it."""
    from tokenmill import LLM

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(str(path), platform=platform, registry=conformance.registry, **engine_args)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    return (tokens, llm) if keep else tokens


def compare(got: list[list[int]], expected: list[list[int]]) -> None:
    for prompt, g, e in zip(PROMPTS, got, expected):
        assert g == e, f"prompt {prompt!r}: plugin {g} != reference {e}"


def layer_backends(llm) -> list[tuple[object, object]]:
    """(attention spec, backend) of every layer of the engine's model (in-process runner)."""
    runner = llm.engine.executor.worker.runner
    model = getattr(runner, "model", None)
    specs = getattr(model, "attention_specs", None)
    backends = getattr(model, "layer_backends", None)
    assert specs and backends, (
        f"cannot see the layers' attention backends of {type(runner).__name__}: T3 needs "
        "the core's in-process runner to tell which backend ran each layer")
    return list(zip(specs, backends, strict=True))


def assert_plugin_backends(llm, active, strict: bool = False) -> None:
    """Every layer ran on one of the plugin's attention backends; with `strict=False` a
    layer may run on the core's reference only where no backend of the plugin supports its
    spec (a declared gap, e.g. sinks), never as a silent fallback."""
    own = {b.name: b for b in active.attention_backends}
    for i, (spec, backend) in enumerate(layer_backends(llm)):
        if backend.name in own:
            continue
        able = [b.name for b in own.values() if b.kind == spec.kind and b.supports(spec)
                and (not spec.sinks or b.supports_sinks)]
        assert not strict and not able, (
            f"layer {i} ({spec.kind.value}, head {spec.head_size}, {spec.num_heads}/"
            f"{spec.num_kv_heads} heads) ran on {backend.name!r}, not on the plugin's "
            f"{able or sorted(own)}: the engine fell back to the core's reference")

