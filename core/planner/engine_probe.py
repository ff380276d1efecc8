"""Engine steps of a tiny model, for the host overhead calibration measures: a llama of
hidden 64 (random weights, a byte-level tokenizer), whose kernels take microseconds, so a
decode step's time is what the engine costs beyond its kernels; and tiny models whose
layers are all of one other kind (MoE, Gated DeltaNet, Mamba2), whose layers' host code
costs more than a llama layer's."""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

logger = logging.getLogger(__name__)

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=272, max_position_embeddings=512,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=2, pad_token_id=0)


# the layer kinds whose host cost beyond a llama layer's the calibration measures: a tiny
# model of each, every layer of that kind ("dense": a llama, attention + gated MLP, the
# base per layer)
KINDS = ("dense", "moe", "gated_delta", "mamba2")


def tiny_config(kind: str, layers: int):
    """The transformers config of a tiny `kind` model: hidden 64, `layers` layers all of
    the kind measured (MoE: 8 experts of 32, top 2, in every layer; gated_delta: Qwen3-Next's
    Gated DeltaNet layers with its MoE; mamba2: Bamba's Mamba2 layers with its MLP)."""
    from transformers import BambaConfig, LlamaConfig, Qwen3MoeConfig, Qwen3NextConfig

    common = dict(TINY, num_hidden_layers=layers)
    if kind == "dense":
        return LlamaConfig(**common)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[])
    if kind == "moe":
        return Qwen3MoeConfig(**common, head_dim=16, norm_topk_prob=True, **moe)
    if kind == "gated_delta":
        return Qwen3NextConfig(**common, head_dim=16, layer_types=["linear_attention"] * layers,
                               linear_num_value_heads=4, linear_num_key_heads=2,
                               linear_key_head_dim=16, linear_value_head_dim=16,
                               linear_conv_kernel_dim=4, shared_expert_intermediate_size=32, **moe)
    if kind == "mamba2":
        return BambaConfig(**common, attn_layer_indices=[], mamba_n_heads=8, mamba_n_groups=2,
                           mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)
    raise ValueError(f"no tiny model of layer kind {kind!r}; known: {', '.join(KINDS)}")


def tiny_model(root: Path, layers: int, kind: str = "dense") -> Path:
    """A tiny random `kind` model of `layers` layers saved under `root` (once per size)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = root / f"{kind}{layers}"
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, layers))
    model.save_pretrained(path)
    vocab = {f"<{i}>": i for i in range(16)} | {chr(32 + i): 16 + i for i in range(256 - 16)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<1>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<1>", eos_token="<2>",
                            pad_token="<0>").save_pretrained(path)
    return path


# a start whose median step is this many times its fastest ran beside other work
BUSY_SPREAD = 3.0


def decode_step_seconds(root: Path, platform: str, layers: int, tensor_parallel: int = 1,
                        steps: int = 24, dtype: str = "float32",
                        pipeline_parallel: int = 1, kind: str = "dense") -> float:
    """Seconds between two tokens of a decoding sequence: at pp1 one decode step of one
    sequence (after its prefill), the median of `steps` steps (what serving's steps see;
    the fastest is 19-24% below it on a quiet 2-core VM). On a machine busy with other
    work a step whose intra-op threads meet another process on a core waits a scheduler
    slice (steps of 1 ms measured at 76-101 ms in bursts that took most of a start,
    docs/planner.md): a warning says when the median is that far above the fastest, and
    the figure is then not to be trusted. At pp > 1
    the pipeline is full, as in serving: pp sequences, a micro-batch each, every engine
    step delivering one of them, so a sequence's token takes pp steps (the median step:
    the stages' steps alternate)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(tiny_model(root, layers, kind)), platform=platform, dtype=dtype,
              tensor_parallel_size=tensor_parallel, pipeline_parallel_size=pipeline_parallel,
              num_kv_blocks=64, enable_prefix_caching=False)
    try:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(pipeline_parallel):
            engine.add_request(engine.next_request_id(), list(range(20 + i, 36 + i)), params)
        for _ in range(2 * pipeline_parallel):  # the prefills, and the pipeline filling
            engine.step()
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        if pipeline_parallel == 1:
            fastest, median = min(times), statistics.median(times)
            if median > BUSY_SPREAD * fastest:
                logger.warning("engine probe (%d layers, tp%d): the median step %.2f ms is %.0fx "
                               "the fastest %.2f ms: other work held the cores; calibrate on a "
                               "quieter machine", layers, tensor_parallel, median * 1e3,
                               median / fastest, fastest * 1e3)
            return median
        return statistics.median(times) * pipeline_parallel
    finally:
        engine.shutdown()
