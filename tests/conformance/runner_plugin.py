"""A test plugin that brings its own model runner (`tokenmill_model_runner`): HF
transformers' implementation, recomputing every sequence in full each step (no KV cache),
sampling with the core's sampler. A separate, pure reference of the model, so tier T3's
greedy comparison with the core's reference platform is a real check of the runner path.

`BUG` names a classic runner bug to plant (the broken_runner_plugin.py variant): the
conformance suite must refuse that one.
"""

from __future__ import annotations

import re

import pluggy
import torch

from tokenmill.platforms.interfaces import (
    AttentionKind,
    KVCacheLayout,
    KVCachePages,
    ModelRunnerBase,
    ModelRunnerContext,
    Platform,
    RunnerCapabilities,
)
from tokenmill.platforms.kit.runner_state import RequestStateTable
from tokenmill.platforms.kit.sampler import Sampler, SamplingRow, prompt_logprobs
from tokenmill.platforms.step import StepDescription, StepResult
from tokenmill_conformance import reference_platform
from tokenmill_conformance.reference_platform import (  # noqa: F401 - hooks re-exported
    tokenmill_allocator,
    tokenmill_attention_backends,
    tokenmill_detect,
    tokenmill_hardware_spec,
)

hookimpl = pluggy.HookimplMarker("tokenmill")

NAME = "hfrunner"
BUG: str | None = None  # "drops_last_token": the last known token never reaches the model


_EXPERT = re.compile(
    r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


def _stack_experts(state: dict) -> dict:
    """Per-expert checkpoint tensors (Qwen3-MoE, Mixtral) -> the stacked parameters
    transformers 5 holds in memory (`mlp.experts.gate_up_proj` / `down_proj`)."""
    experts: dict[str, dict[int, dict[int, object]]] = {}
    out = {}
    for name, tensor in state.items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        layer, expert, proj = match.groups()
        experts.setdefault(layer, {}).setdefault(int(expert), {})[_PART[proj]] = tensor
    for layer, by_expert in experts.items():
        ids = sorted(by_expert)
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((by_expert[e][0], by_expert[e][1])) for e in ids]
        )
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([by_expert[e][2] for e in ids])
    return out


class TransformersRunner(ModelRunnerBase):
    def __init__(self, context: ModelRunnerContext, bug: str | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.context = context
        self.bug = bug
        model = AutoModelForCausalLM.from_config(context.hf_config, dtype=context.dtype)
        state = _stack_experts(dict(context.weights()))
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = getattr(context.hf_config, "tie_word_embeddings", False)
        if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
            raise KeyError(f"checkpoint does not fit: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        self.model = model.to(context.device).eval()
        self.requests = RequestStateTable(context.device)
        self.sampler = Sampler()
        self.num_steps = 0

    def capabilities(self) -> RunnerCapabilities:
        # it recomputes every sequence instead of caching: no KV in the pages to offload
        return RunnerCapabilities(attention_kinds=frozenset(AttentionKind))

    def kv_cache_layout(self) -> KVCacheLayout:
        # nominal: the pages go unused, but the pool is sized the same way
        return KVCacheLayout(self.context.kv_cache.attention_specs)

    def bind_kv_cache(self, pages: KVCachePages) -> None:
        self.num_blocks = pages.num_blocks

    @torch.inference_mode()
    def execute(self, step: StepDescription) -> StepResult:
        self.num_steps += 1
        out = StepResult()
        batch = self.requests.update(step)
        sampling = [row for row in batch if row.sample]
        if sampling:
            logits = torch.stack([self._logits(row.state)[-1] for row in sampling])
            rows = [SamplingRow(r.state.sampling, r.state.prompt_token_ids,
                                r.state.output_token_ids, r.state.generator) for r in sampling]
            sampled = self.sampler(logits, rows)
            for row, token_id, lp in zip(sampling, sampled.token_ids, sampled.logprobs):
                out.sampled_token_ids[row.state.request_id] = token_id
                if lp is not None:
                    out.logprobs[row.state.request_id] = lp
        for rid, (lo, hi) in step.prompt_logprob_ranges.items():
            state = self.requests.requests[rid]
            logits = self._logits(state)[lo:hi]
            next_ids = state.token_ids(lo + 1, hi + 1)
            out.prompt_logprobs[rid] = (lo, prompt_logprobs(logits, next_ids,
                                                            state.sampling.prompt_logprobs))
        return out

    def _logits(self, state) -> torch.Tensor:
        ids = state.prompt_token_ids + state.output_token_ids
        if self.bug == "drops_last_token" and len(ids) > 1:
            ids = ids[:-1]
        tensor = torch.tensor([ids], device=self.context.device)
        return self.model(tensor).logits[0].float()


@hookimpl
def tokenmill_api_version() -> str:
    return "1.6"


@hookimpl
def tokenmill_platform() -> Platform:
    import dataclasses

    return dataclasses.replace(reference_platform.tokenmill_platform(), name=NAME)


@hookimpl
def tokenmill_model_runner(
    platform: Platform, context: ModelRunnerContext
) -> ModelRunnerBase | None:
    # recomputing a hybrid's recurrent layers over every whole sequence each step is slow
    # in transformers' torch paths: it declines those models (the core's runner serves
    # them), as the hook's contract allows
    if any(s.kind == AttentionKind.LINEAR for s in context.kv_cache.attention_specs):
        return None
    return TransformersRunner(context, BUG)
