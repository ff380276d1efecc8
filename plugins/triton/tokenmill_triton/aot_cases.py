"""The launches `tokenmill_triton.aot` compiles: every kernel of the package through its own
launcher, at production shapes, in every launch configuration a plugin's `KernelConfigs`
gives it.

What varies a kernel's code is its constexprs and its pointer dtypes, so the cases cover,
per kernel:
- paged attention: each dtype x head size 64/128/256 x path (prefill tiles, decode
  tiles, decode split-K with its combine kernel), the GQA ratio 1/4/8, windows and sinks
  cycled across them (they change a mask, not the tiles); the KV write per dtype and head;
- MLA: rank 512 / rope 64 (DeepSeek-V3, Kimi) and a small rank, per cache dtype;
- Gated DeltaNet, KDA and Mamba2: the conv, the chunked scan and the recurrence per dtype
  at production head dims (128; Mamba2 head 64, state 128);
- MoE: the grouped GEMMs with and without biases, both activations, per dtype;
- the weight-only quantized GEMM: int4 in groups of 128, 8-bit codes in groups of 32
  (Q8_0) and FP8 e4m3 in 1 x 128 blocks, decode (16-row tiles) and prefill tiles, per
  dtype;
- the elementwise ops per dtype at hidden 4096.

The tensors are CPU tensors: under `aot.compiling_for` no kernel runs, each launch only
compiles. Shapes are the smallest that reach the production specialisation (a launch's
code depends on the shapes' constexprs, not on the number of tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import cycle

import torch

from tokenmill.platforms.interfaces import AttentionMetadata
from tokenmill_triton.configs import KernelConfigs

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEADS = (64, 128, 256)
GROUPS = (1, 4, 8)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _metadata(seqs: list[tuple[int, int]], block_size: int) -> AttentionMetadata:
    query_lens = [n for _, n in seqs]
    seq_lens = [c + n for c, n in seqs]
    width = max(-(-s // block_size) for s in seq_lens)
    tables = torch.arange(width, dtype=torch.int32).repeat(len(seqs), 1)
    starts = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(query_lens).cumsum(0)
    slots = torch.cat([torch.arange(c, c + n) for c, n in seqs]).to(torch.int64)
    return AttentionMetadata(
        num_tokens=sum(query_lens), num_seqs=len(seqs), query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=slots, query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=block_size,
    )


# path -> (cached, new) per sequence: a prefill chunk; decodes below the split-K switch;
# decodes past it (every config switches at or below 8k)
PATHS = {
    "prefill": [(100, 70), (0, 1)],
    "decode": [(100, 1), (1, 1)],
    "split_decode": [(8192, 1), (100, 1)],
}


def _attention(configs: KernelConfigs, dtype, head, group, path, window, sinks) -> None:
    from tokenmill_triton.attention import paged_attention, write_kv

    kv_heads, block = 2, 16
    meta = _metadata(PATHS[path], block)
    cache = torch.empty(2, meta.block_tables.shape[1], block, kv_heads, head, dtype=dtype)
    q = torch.empty(meta.num_tokens, kv_heads * group, head, dtype=dtype)
    kv = torch.empty(meta.num_tokens, kv_heads, head, dtype=dtype)
    write_kv(kv, kv, cache, meta.slot_mapping, configs)
    sink = torch.zeros(kv_heads * group) if sinks else None
    paged_attention(q, cache, meta, 0.1, configs, window, sink)


def _mla(configs: KernelConfigs, dtype, rank, rope) -> None:
    from tokenmill_triton.mla import latent_attention

    meta = _metadata([(100, 70), (300, 1)], 16)
    cache = torch.empty(meta.block_tables.shape[1], 16, rank + rope, dtype=dtype)
    q = torch.empty(meta.num_tokens, 16, rank + rope, dtype=torch.float32)
    token_seq = torch.zeros(meta.num_tokens, dtype=torch.int32)
    latent_attention(q, cache, meta, token_seq, rank, 0.1, configs)


def _linear(configs: KernelConfigs, dtype, variant: str, decode: bool) -> None:
    from tokenmill_triton import gated_delta, kda, mamba2

    lens = [1, 1] if decode else [130, 1]
    t = sum(lens)
    if variant == "mamba2":
        heads, p, groups, n = 8, 64, 2, 128
        x = torch.empty(t, heads, p, dtype=dtype)
        bc = torch.empty(t, groups, n, dtype=dtype)
        args = (x, torch.empty(t, heads, dtype=dtype), torch.empty(heads), bc, bc,
                torch.empty(heads, dtype=dtype), torch.empty(heads, dtype=dtype),
                torch.zeros(len(lens), heads, p, n))
        conv = heads * p + 2 * groups * n
        if decode:
            mamba2.mamba2_state_update(*args, lens, configs=configs)
        else:
            mamba2.mamba2_chunked(*args, lens, [[64, 130], []], configs=configs)
    else:
        hk, hv, d = (4, 8, 128) if variant == "gated_delta" else (8, 8, 128)
        qk = torch.empty(t, hk, d, dtype=dtype)
        v = torch.empty(t, hv, d, dtype=dtype)
        g = torch.empty((t, hv) if variant == "gated_delta" else (t, hv, d))
        beta = torch.empty(t, hv, dtype=dtype)
        states = torch.zeros(len(lens), hv, d, d)
        module = gated_delta if variant == "gated_delta" else kda
        scan = getattr(module, f"{variant}_{'recurrent' if decode else 'chunked'}")
        extra = {} if decode else {"checkpoints": [[64, 130], []]}
        scan(qk, qk, v, g, beta, states, lens, configs=configs, **extra)
        conv = 2 * hk * d + hv * d
    x = torch.empty(t, conv, dtype=dtype)
    weight = torch.empty(conv, 4, dtype=dtype)
    gated_delta.causal_conv1d(x, weight, torch.zeros(len(lens), conv, 3, dtype=dtype), lens,
                              torch.empty(conv, dtype=dtype) if variant == "mamba2" else None,
                              configs=configs)


def _moe(configs: KernelConfigs, dtype, biased: bool) -> None:
    from tokenmill_triton.moe import moe_experts

    tokens, hidden, inter, experts, k = 33, 1024, 512, 8, 2
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    moe_experts(torch.zeros(tokens, hidden, dtype=dtype),
                torch.zeros(experts, 2 * inter, hidden, dtype=dtype),
                torch.zeros(experts, hidden, inter, dtype=dtype),
                torch.full((tokens, k), 0.5), ids,
                torch.zeros(experts, 2 * inter, dtype=dtype) if biased else None,
                torch.zeros(experts, hidden, dtype=dtype) if biased else None,
                "swiglu_oai" if biased else "silu", configs=configs)


def _quant(configs: KernelConfigs, dtype, form: str) -> None:
    from tokenmill.platforms.ops import quant
    from tokenmill_triton.quant import TritonQuantizedLinear

    out, hidden = 4096, 4096
    if form == "q8_0 g32":
        weight = quant.QuantizedWeight(
            quant.QuantScheme("gguf", "Q8_0", 8, 32), torch.zeros(out, hidden, dtype=torch.uint8),
            torch.ones(out, hidden // 32), torch.zeros(out, hidden // 32), hidden, out)
    elif form == "fp8 1x128":
        scheme = quant.QuantScheme("fp8", "fp8_e4m3", 8, zero_points=False, fp8_block=(1, 128))
        weight = quant.QuantizedWeight(
            scheme, torch.zeros(out, hidden, dtype=torch.float8_e4m3fn),
            torch.ones(out, hidden // 128), None, hidden, out)
    else:
        weight = quant.QuantizedWeight(
            quant.QuantScheme("awq", "int4", 4, 128), torch.zeros(out, hidden // 2, dtype=torch.uint8),
            torch.ones(out, hidden // 128), torch.zeros(out, hidden // 128), hidden, out)
    layer = TritonQuantizedLinear(weight, None, configs)
    for tokens in (1, 33):  # decode tiles, prefill tiles
        layer(torch.zeros(tokens, hidden, dtype=dtype))


def _elementwise(configs: KernelConfigs, dtype) -> None:
    from tokenmill_triton import elementwise as ew

    cfg = configs.elementwise
    tokens, hidden = 7, 4096
    x = torch.zeros(tokens, hidden, dtype=dtype)
    w = torch.zeros(hidden, dtype=dtype)
    ew.rms_norm(x, w, 1e-6, cfg)
    ew.fused_add_rms_norm(x, x, w, 1e-6, cfg)
    ew.silu_and_mul(torch.zeros(tokens, 2 * hidden, dtype=dtype), cfg)
    ew.gelu_tanh_and_mul(torch.zeros(tokens, 2 * hidden, dtype=dtype), cfg)
    q, k = torch.zeros(tokens, 32, 128, dtype=dtype), torch.zeros(tokens, 8, 128, dtype=dtype)
    ew.rotary_embedding(torch.zeros(tokens, dtype=torch.int64), q, k,
                        torch.zeros(4096, 128), cfg)
    ew.apply_token_bitmask(torch.zeros(4, 151936, dtype=dtype),
                           torch.zeros(4, 4748, dtype=torch.int32),
                           torch.arange(4), cfg)


def launch_cases(configs: KernelConfigs) -> dict[str, Callable[[], None]]:
    """Case name -> a launch at production shapes (module docstring)."""
    cases: dict[str, Callable[[], None]] = {}
    groups, flags = cycle(GROUPS), cycle([(None, False), (1000, False), (None, True)])
    for dtype in DTYPES:
        for head in HEADS:
            for path in PATHS:
                group, (window, sinks) = next(groups), next(flags)
                name = (f"attention {path} {_name(dtype)} head {head} gqa {group}"
                        f"{f' window {window}' if window else ''}{' sinks' if sinks else ''}")
                cases[name] = functools.partial(_attention, configs, dtype, head, group,
                                                path, window, sinks)
        for rank, rope in ((512, 64), (64, 16)):
            cases[f"mla {_name(dtype)} rank {rank} rope {rope}"] = functools.partial(
                _mla, configs, dtype, rank, rope)
        for variant in ("gated_delta", "kda", "mamba2"):
            for decode in (False, True):
                cases[f"{variant} {'recurrent' if decode else 'chunked'} {_name(dtype)}"] = (
                    functools.partial(_linear, configs, dtype, variant, decode))
        for biased in (False, True):
            cases[f"moe {_name(dtype)}{' biased swiglu_oai' if biased else ' silu'}"] = (
                functools.partial(_moe, configs, dtype, biased))
        for form in ("int4 g128", "q8_0 g32", "fp8 1x128"):
            cases[f"quant {form} {_name(dtype)}"] = functools.partial(_quant, configs, dtype,
                                                                      form)
        cases[f"elementwise {_name(dtype)}"] = functools.partial(_elementwise, configs, dtype)
    return cases
