"""Multi-head latent attention (MLA, DeepSeek-V2/V3 and Kimi): the pure-PyTorch reference.

An MLA layer caches, per token, one latent row instead of per-head keys and values:
`c_kv` (kv_lora_rank values, already normalised) then `k_pe` (qk_rope_head_dim values,
already rotated), shared by every head. Head h attends with

    key_h   = cat(w_uk[h] @ c_kv, k_pe)        [qk_nope_head_dim + qk_rope_head_dim]
    value_h = w_uv[h] @ c_kv                   [v_head_dim]

Two exact ways to compute it, both here:

- decompressed ("prefill" form): expand every cached latent into per-head keys and
  values, then ordinary causal attention. Costs O(keys x heads x (nope + v) x rank) to
  expand, cheap when many queries share the keys (a prompt);
- absorbed ("decode" form): fold w_uk into the query, q_lat[h] = w_uk[h].T @ q_nope[h]
  (rank values), so scores are q_lat[h] . c_kv + q_pe[h] . k_pe straight off the cache;
  the attention output stays latent, o_lat[h] = sum_k p_k c_kv[k], and w_uv is applied
  once after: out[h] = w_uv[h] @ o_lat[h]. Reads only the latent cache, the point of MLA
  when one query reads a long context.

`mla_attention` picks per sequence (one query row: absorbed; more: decompressed) unless
told; the arguments follow `AttentionBackend.forward` for the MLA kind (see
`tokenmill.platforms.interfaces.MLADims`). Float32 math, one sequence at a time.
"""

from __future__ import annotations

import torch

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


def write_latent(
    latent: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> None:
    """Scatter the step's latent rows [T, 1 or absent, latent] into the paged cache
    [num_blocks, block_size, latent] at `slot_mapping` (int64 [T]); a quantized (FP8)
    cache stores them divided by `scale` (float32 [1])."""
    rows = latent.reshape(-1, kv_cache.shape[-1])
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    if is_quantized(kv_cache.dtype):  # as bytes: torch's CPU index_copy_ takes no FP8
        stored = quantize_kv(rows, scale, kv_cache.dtype)
        flat.view(torch.uint8).index_copy_(0, slot_mapping, stored.view(torch.uint8))
        return
    flat.index_copy_(0, slot_mapping, rows.to(kv_cache.dtype))


def gather_latent(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` cached latent rows of one sequence, in order: [seq_len, latent]."""
    block_size = kv_cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)].long()
    return kv_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]


def _check(spec: AttentionSpec, query: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> None:
    dims = spec.mla
    if spec.kind != AttentionKind.MLA or dims is None:
        raise ValueError(f"mla_attention needs an MLA spec, got kind {spec.kind.value!r}")
    heads = spec.num_heads
    expected = {
        "query": ((query.shape[0], heads, dims.qk_head_dim), query),
        "w_uk": ((heads, dims.qk_nope_head_dim, dims.kv_lora_rank), w_uk),
        "w_uv": ((heads, dims.v_head_dim, dims.kv_lora_rank), w_uv),
    }
    for name, (shape, tensor) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"MLA {name} has shape {tuple(tensor.shape)}, expected {shape}")


def mla_attention(
    spec: AttentionSpec,
    query: torch.Tensor,
    key: torch.Tensor,
    value: None,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    absorbed: bool | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference MLA over a paged latent cache; returns [num_tokens, num_heads, v_head_dim].

    `query` [T, H, nope + rope] (q_nope | roped q_pe), `key` [T, 1, rank + rope] (c_kv |
    roped k_pe: written into `kv_cache` [num_blocks, block_size, rank + rope] at
    `metadata.slot_mapping` first), `value` unused (None), `w_uk` [H, nope, rank], `w_uv`
    [H, v, rank]. Each query attends causally to its sequence's context, scaled by
    `spec.scale`. `absorbed`: True or False forces one form for every sequence; None
    takes the absorbed form for single-row (decode) sequences and decompresses for the
    others. `k_scale` (float32 [1], given exactly when `spec.cache_dtype`): the latent
    cache is quantized, rows read back as stored * k_scale (`v_scale` is unused). Does not
    modify its inputs other than `kv_cache`.
    """
    if value is not None:
        raise ValueError("MLA has no separate value: pass value=None (values come from c_kv)")
    _check(spec, query, w_uk, w_uv)
    dims = spec.mla
    rank, nope = dims.kv_lora_rank, dims.qk_nope_head_dim
    if (k_scale is not None) != (spec.cache_dtype is not None):
        raise ValueError(f"spec.cache_dtype={spec.cache_dtype} but k_scale={k_scale}: a "
                         "quantized latent cache takes k_scale, any other none")
    write_latent(key, kv_cache, metadata.slot_mapping, k_scale)
    scale = spec.scale if spec.scale is not None else dims.qk_head_dim**-0.5
    w_uk32, w_uv32 = w_uk.float(), w_uv.float()
    out = torch.empty(query.shape[0], spec.num_heads, dims.v_head_dim, dtype=query.dtype,
                      device=query.device)
    starts = metadata.query_start_loc.tolist()
    for i in range(metadata.num_seqs):
        q = query[starts[i] : starts[i + 1]].float()  # [q_len, H, nope + rope]
        q_len, seq_len = q.shape[0], metadata.seq_lens_cpu[i]
        latent = gather_latent(kv_cache, metadata.block_tables[i], seq_len)
        latent = latent.float() if k_scale is None else dequantize_kv(latent, k_scale)
        c_kv, k_pe = latent[:, :rank], latent[:, rank:]
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        use_absorbed = (q_len == 1) if absorbed is None else absorbed
        rope_scores = torch.einsum("qhr,kr->hqk", q_pe, k_pe)
        if use_absorbed:
            q_lat = torch.einsum("qhn,hnc->qhc", q_nope, w_uk32)  # W_UK folded into q
            scores = torch.einsum("qhc,kc->hqk", q_lat, c_kv) + rope_scores
        else:
            k_nope = torch.einsum("kc,hnc->khn", c_kv, w_uk32)  # per-head keys
            scores = torch.einsum("qhn,khn->hqk", q_nope, k_nope) + rope_scores
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        scores = scores.mul(scale).masked_fill(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        if use_absorbed:
            o_lat = torch.einsum("hqk,kc->qhc", probs, c_kv)  # latent output
            o = torch.einsum("qhc,hvc->qhv", o_lat, w_uv32)  # W_UV applied after
        else:
            v = torch.einsum("kc,hvc->khv", c_kv, w_uv32)
            o = torch.einsum("hqk,khv->qhv", probs, v)
        out[starts[i] : starts[i + 1]] = o.to(out.dtype)
    return out


class ReferenceMLABackend(AttentionBackend):
    """The core's MLA oracle (and the fallback of a platform without an MLA backend)."""

    name = "reference_mla"
    kind = AttentionKind.MLA
    kv_cache_dtypes = QUANTIZED_KV_DTYPES

    def supports(self, spec: AttentionSpec) -> bool:
        return spec.kind == AttentionKind.MLA and (
            spec.cache_dtype is None or spec.cache_dtype in self.kv_cache_dtypes
        )

    def forward(self, spec, query, key, value, kv_cache, metadata, *, w_uk, w_uv,
                k_scale=None, v_scale=None):
        return mla_attention(spec, query, key, value, kv_cache, metadata, w_uk=w_uk, w_uv=w_uv,
                             k_scale=k_scale, v_scale=v_scale)
