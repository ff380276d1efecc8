"""Pure-PyTorch reference ops.

These are the conformance oracle and the fallback for every platform: they favour being
obviously correct over being fast. A plugin may override an op by name through the
`tokenmill_ops` hook with a function of the same signature.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.ops.kv_quant import (
    QUANTIZED_KV_DTYPES,
    dequantize_kv,
    is_quantized,
    quantize_kv,
)
from tokenmill.platforms.ops.quant import prepack_quantized_linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32."""
    orig_dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(orig_dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual). Does not modify its inputs."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotary_embedding(
    positions: torch.Tensor,  # int64 [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    cos_sin_cache: torch.Tensor,  # float32 [max_position, rotary_dim] (cos half | sin half)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding on the first rotary_dim of each head."""
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rotary_dim = cos_sin_cache.shape[-1]

    def apply(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        x1, x2 = rot.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((out, rest), dim=-1) if rest.numel() else out

    return apply(query), apply(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x is [..., 2 * d] holding (gate | up); returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x is [..., 2 * d] holding (gate | up); returns gelu_tanh(gate) * up (Gemma's MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


MOE_ACTIVATIONS = ("silu", "swiglu_oai")


def moe_activation(
    gate_up: torch.Tensor, activation: str, swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """act(gate, up) of `moe_experts` for one expert's rows `gate_up` [n, 2I] (gate
    columns, then up): [n, I]. Does not modify its input."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(-swiglu_limit, swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * swiglu_alpha))


def moe_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """The routed experts of a mixture-of-experts layer, each token through its top k.

    Shapes: `hidden` [T, H]; `w13` [E, 2I, H], each expert's gate rows then its up rows
    (nn.Linear layout: out x in); `w2` [E, H, I]; `topk_weights` float32 [T, k], the
    routing weights the model's router normalised; `topk_ids` int64 [T, k] in [0, E);
    optional biases `w13_bias` [E, 2I] and `w2_bias` [E, H]. Returns [T, H] in
    hidden.dtype:

        out[t] = sum_j topk_weights[t, j] * (w2[e] @ act(w13[e] @ hidden[t] + b13[e]) + b2[e])

    with e = topk_ids[t, j], and `act` one of MOE_ACTIVATIONS: "silu" is silu(gate) * up;
    "swiglu_oai" is gpt-oss's (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g) with
    g = gate.clamp(max=limit). Each expert's matmuls run in the weights' dtype; the
    weighted sum accumulates in float32. Does not modify its inputs.
    """
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"MoE activation {activation!r} is not one of {MOE_ACTIVATIONS}")
    num_experts = w13.shape[0]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.flatten()
    token_of = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(
        topk_ids.shape[1]
    )
    flat_weights = topk_weights.flatten().float()
    for e in torch.unique(flat_ids).tolist():
        if not 0 <= e < num_experts:
            raise ValueError(f"topk_ids holds expert {e}; the layer has {num_experts} experts")
        picks = (flat_ids == e).nonzero()[:, 0]
        tokens = token_of[picks]
        bias13 = None if w13_bias is None else w13_bias[e]
        gate_up = F.linear(hidden[tokens], w13[e], bias13)
        act = moe_activation(gate_up, activation, swiglu_alpha, swiglu_limit)
        y = F.linear(act, w2[e], None if w2_bias is None else w2_bias[e])
        out.index_add_(0, tokens, y.float() * flat_weights[picks, None])
    return out.to(hidden.dtype)


def prepack_linear(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Called once per linear layer after its weights are loaded; returns y = f(x) computing
    x @ weight.T + bias. A platform may repack the weight into its preferred layout here
    (the returned function owns the packed copy). Does not modify `weight` or `bias`."""
    return functools.partial(F.linear, weight=weight, bias=bias)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter the step's key/value rows into the paged cache at their slots; a quantized
    (FP8) cache stores them scaled by `k_scale` / `v_scale` (float32 [num_kv_heads],
    `tokenmill.platforms.ops.kv_quant`)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    if is_quantized(kv_cache.dtype):  # as bytes: torch's CPU index_copy_ takes no FP8
        flat = flat.view(torch.uint8)
        for half, x, scale in ((0, key, k_scale), (1, value, v_scale)):
            stored = quantize_kv(x, scale, kv_cache.dtype)
            flat[half].index_copy_(0, slot_mapping, stored.view(torch.uint8))
        return
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def check_kv_scales(spec: AttentionSpec, k_scale: object, v_scale: object) -> None:
    """ValueError unless the scales are given exactly for a quantized cache (`spec.cache_dtype`)."""
    given = (k_scale is not None, v_scale is not None)
    quantized = spec.cache_dtype is not None
    if given != (quantized, quantized):
        raise ValueError(
            f"spec.cache_dtype={spec.cache_dtype} but k_scale / v_scale "
            f"{'missing' if quantized else 'given'}: a quantized cache "
            f"({sorted(map(str, QUANTIZED_KV_DTYPES))}) takes both, any other neither"
        )


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first_block: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached key and value rows of one sequence from block `first_block` up to
    position `seq_len`, in order. Entries of the table before `first_block` are not read
    (a sliding window's table holds the null block there)."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[first_block:num_blocks].long()
    length = seq_len - first_block * block_size
    k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:length]
    v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:length]
    return k, v


def copy_blocks(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Copy whole KV blocks within each layer's cache (copy-on-write of shared blocks).

    `kv_caches` holds one [2, num_blocks, block_size, num_kv_heads, head_size] tensor per
    layer; `block_mapping` is int64 [n, 2] of (src block, dst block) pairs. Keys and values
    of every layer are copied. Sources are read before any destination is written, so a
    block may be both a source and a destination. Modifies only the destination blocks.
    """
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for cache in kv_caches:
        cache[:, dst.to(cache.device)] = cache[:, src.to(cache.device)]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Move KV blocks between two caches of one layer, e.g. device to host and back.

    `src` and `dst` are [2, num_blocks, block_size, num_kv_heads, head_size] tensors of the
    same dtype and block shape, possibly on different devices and with different block
    counts; `block_mapping` is int64 [n, 2] of (src block, dst block) pairs. Does not
    modify `src`; modifies only the mapped blocks of `dst`.
    """
    if block_mapping.numel() == 0:
        return
    src_ids, dst_ids = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    blocks = src[:, src_ids.to(src.device)]
    dst[:, dst_ids.to(dst.device)] = blocks.to(dst.device)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor
) -> None:
    """Structured output's token mask: in place, sets to -inf the logits of the tokens a
    row's grammar does not allow.

    `logits` is float [num_rows, vocab]; `bitmask` int32 [k, num_words] where bit j (LSB
    first) of word w allows token 32 * w + j; `row_indices` int64 [k] names the logits row
    each mask row applies to (distinct). Bits beyond `vocab` are ignored; columns beyond
    32 * num_words are disallowed. Rows not named are untouched; does not modify `bitmask`.
    """
    if row_indices.numel() == 0:
        return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [k, 32 * num_words]
    if allowed.shape[1] < vocab:
        allowed = F.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab].to(logits.device)
    rows = row_indices.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def paged_attention(
    spec: AttentionSpec,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference paged attention: one sequence at a time, explicit masks, float32 math.

    Full attention is causal over the whole context; with `spec.sliding_window = w` a query
    at position p sees positions (p - w, p]. `sinks` (float32 [num_heads], given exactly
    when `spec.sinks`) adds one logit per head to every query's softmax that carries no
    value: the probabilities of the real keys then sum to less than one. `k_scale` /
    `v_scale` (float32 [num_kv_heads], given exactly when `spec.cache_dtype`): the cache
    is quantized; keys and values are read back as stored * scale (every key, the step's
    own included, as the cache holds it).
    """
    if (sinks is not None) != spec.sinks:
        raise ValueError(f"spec.sinks={spec.sinks} but sinks {'not ' * (sinks is None)}given")
    check_kv_scales(spec, k_scale, v_scale)
    write_kv(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale)
    scale = spec.scale if spec.scale is not None else spec.head_size**-0.5
    group = spec.num_heads // spec.num_kv_heads
    block_size = kv_cache.shape[2]
    out = torch.empty_like(query)
    starts = metadata.query_start_loc.tolist()
    for i in range(metadata.num_seqs):
        q = query[starts[i] : starts[i + 1]].float()  # [q_len, H, D]
        q_len = q.shape[0]
        seq_len = metadata.seq_lens_cpu[i]
        # a window reads only the blocks from its first query's first visible position
        first_block = 0
        if spec.sliding_window is not None:
            first_block = max(0, seq_len - q_len - spec.sliding_window + 1) // block_size
        k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len, first_block)
        if k_scale is not None:
            k, v = dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)
        k = k.float().repeat_interleave(group, dim=1)  # [keys, H, D]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(first_block * block_size, seq_len).unsqueeze(0)
        visible = k_pos <= q_pos
        if spec.sliding_window is not None:
            visible &= k_pos > q_pos - spec.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


class ReferenceAttentionBackend(AttentionBackend):
    """The core's oracle backend; every platform's attention is compared against it."""

    name = "reference"
    kind = AttentionKind.FULL
    supports_sinks = True
    kv_cache_dtypes = QUANTIZED_KV_DTYPES

    def supports(self, spec: AttentionSpec) -> bool:
        return spec.kind in (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW) and (
            spec.cache_dtype is None or spec.cache_dtype in self.kv_cache_dtypes
        )

    def forward(self, spec, query, key, value, kv_cache, metadata, sinks=None, k_scale=None,
                v_scale=None):
        return paged_attention(spec, query, key, value, kv_cache, metadata, sinks, k_scale,
                               v_scale)


REFERENCE_OPS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
    "gelu_tanh_and_mul": gelu_tanh_and_mul,
    "moe_experts": moe_experts,
    "prepack_linear": prepack_linear,
    "prepack_quantized_linear": prepack_quantized_linear,
    "copy_blocks": copy_blocks,
    "swap_blocks": swap_blocks,
    "apply_token_bitmask": apply_token_bitmask,
}
