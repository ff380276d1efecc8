"""Multi-head latent attention (MLA) on CPU, vectorized over the step's rows.

The cache is the core's standard MLA layout, [num_blocks, block_size, kv_lora_rank +
rope_dim]: one latent row (c_kv | k_pe) per token. Per layer (`forward`):

- the step's latent rows are written with one `index_copy_`;
- decode rows (query_len 1), all in one batch, in the absorbed form: q_nope is folded
  through W_UK into the latent space, so with q = (q_lat | q_pe) a row's scores are one
  matmul against its cached latent rows, which double as the values (their c_kv part);
  the latent output goes through W_UV once. Rows are bucketed by context length (a
  bucket takes rows while their length is at least 3/4 of its longest) so padding stays
  small; padding positions read the row's own first latent (written memory: unwritten
  memory may hold NaN, and 0 * NaN is NaN) and are masked out of the softmax;
- prefill and chunk rows one sequence at a time, decompressed: the sequence's cached
  latents are expanded through W_UK / W_UV into per-head keys and values (a prompt's
  queries share them), then one SDPA call with a bottom-right causal mask.

All math is float32 (CPU float32 GEMMs on strided operands beat bf16 ones here; the
cache stays in the model dtype). The per-step plan (buckets, masks,
gather indices) is built by the first layer and reused by the others through
`metadata.backend_state`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
)
from tokenmill.platforms.ops.kv_quant import QUANTIZED_KV_DTYPES, dequantize_kv
from tokenmill.platforms.ops.mla import write_latent

SUPPORTED_DTYPES = frozenset({torch.float32, torch.bfloat16})
_BUCKET_FILL = 0.75


@dataclass(slots=True)
class _Bucket:
    rows: torch.Tensor  # int64 [b]: the decode rows' positions in the step's flat batch
    slots: torch.Tensor  # int64 [b, n]: cache slot of each key position (padding: the first)
    valid: torch.Tensor  # bool [b, n]: key position inside the row's context
    bias: torch.Tensor  # float32 [b, 1, n]: 0 inside the context, -inf for padding


@dataclass(slots=True)
class _Plan:
    decode: list[_Bucket]
    # prefill / chunk sequences: (first query row, query length, slots of the context)
    prefill: list[tuple[int, int, torch.Tensor]]


def _build_plan(metadata: AttentionMetadata) -> _Plan:
    block_size = metadata.block_size
    starts = metadata.query_start_loc.tolist()
    tables = metadata.block_tables.long()
    offsets = torch.arange(block_size, device=tables.device)
    decode_rows: list[tuple[int, int]] = []  # (seq index, seq_len)
    prefill = []
    for i in range(metadata.num_seqs):
        seq_len, q_len = metadata.seq_lens_cpu[i], metadata.query_lens_cpu[i]
        if q_len == 1:
            decode_rows.append((i, seq_len))
            continue
        blocks = tables[i, : -(-seq_len // block_size)]
        slots = (blocks[:, None] * block_size + offsets).flatten()[:seq_len]
        prefill.append((starts[i], q_len, slots))
    decode_rows.sort(key=lambda r: -r[1])
    buckets = []
    while decode_rows:
        longest = decode_rows[0][1]
        take = [r for r in decode_rows if r[1] >= _BUCKET_FILL * longest]
        decode_rows = decode_rows[len(take):]
        seqs = torch.tensor([i for i, _ in take], device=tables.device)
        lens = torch.tensor([n for _, n in take], device=tables.device)
        num_blocks = -(-longest // block_size)
        slots = (tables[seqs, :num_blocks, None] * block_size + offsets).flatten(1)[:, :longest]
        valid = torch.arange(longest, device=tables.device) < lens[:, None]
        rows = torch.tensor([starts[i] for i, _ in take], device=tables.device)
        # padding reads the row's own first slot (written, so finite) and is masked
        bias = torch.zeros(valid.shape, dtype=torch.float32).masked_fill(~valid, float("-inf"))
        buckets.append(
            _Bucket(rows, torch.where(valid, slots, slots[:, :1]), valid, bias[:, None, :])
        )
    return _Plan(buckets, prefill)


class CpuMLAAttention(AttentionBackend):
    """MLA over the standard latent cache, fp32 or bf16, any block size and rank."""

    name = "cpu_mla"
    kind = AttentionKind.MLA
    kv_cache_dtypes = QUANTIZED_KV_DTYPES  # an FP8 latent cache, one scale per layer

    def supports(self, spec: AttentionSpec) -> bool:
        return (
            spec.kind == AttentionKind.MLA and spec.dtype in SUPPORTED_DTYPES
            and (spec.cache_dtype is None or spec.cache_dtype in self.kv_cache_dtypes)
        )

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Drops the previous step's plan; the first layer of the step builds the new one."""
        metadata.backend_state.pop(self.name, None)

    def _plan(self, metadata: AttentionMetadata) -> _Plan:
        plan = metadata.backend_state.get(self.name)
        if plan is None:
            plan = metadata.backend_state[self.name] = _build_plan(metadata)
        return plan

    def forward(self, spec, query, key, value, kv_cache, metadata, *, w_uk, w_uv,
                k_scale=None, v_scale=None):
        """See `AttentionBackend.forward` (MLA) and `tokenmill.platforms.ops.mla.mla_attention`
        (an FP8 latent cache: rows dequantized by `k_scale` as they are read)."""
        if value is not None:
            raise ValueError("MLA has no separate value: pass value=None")
        if (k_scale is not None) != (spec.cache_dtype is not None):
            raise ValueError(f"spec.cache_dtype={spec.cache_dtype} but k_scale={k_scale}: a "
                             "quantized latent cache takes k_scale, any other none")
        write_latent(key, kv_cache, metadata.slot_mapping, k_scale)
        dims = spec.mla
        scale = spec.scale if spec.scale is not None else dims.qk_head_dim**-0.5
        plan = self._plan(metadata)
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        out = torch.empty(query.shape[0], spec.num_heads, dims.v_head_dim, dtype=query.dtype)
        for bucket in plan.decode:
            latent = _rows(flat, bucket.slots, k_scale)
            o = self._decode(query[bucket.rows], latent, bucket, dims, scale, w_uk, w_uv)
            out[bucket.rows] = o.to(out.dtype)
        for first, q_len, slots in plan.prefill:
            q = query[first : first + q_len]
            o = self._prefill(q, _rows(flat, slots, k_scale), dims, scale, w_uk, w_uv)
            out[first : first + q_len] = o.to(out.dtype)
        return out

    @staticmethod
    def _decode(q, latent, bucket: _Bucket, dims, scale, w_uk, w_uv) -> torch.Tensor:
        """Absorbed form for b decode rows: q [b, H, nope + rope] over their latent rows
        (float32 [b, n, rank + rope]; padding masked below) -> [b, H, v], in float32
        (CPU float32 GEMMs with strided operands are faster than bf16 ones here)."""
        rank, nope = dims.kv_lora_rank, dims.qk_nope_head_dim
        q = q.float()
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk.float())  # [H, b, rank]
        q_full = torch.cat((q_lat.transpose(0, 1), q[..., nope:]), dim=-1)  # [b, H, rank+rope]
        scores = torch.baddbmm(
            bucket.bias, q_full, latent.transpose(1, 2), alpha=scale
        )  # [b, H, n]
        probs = scores.softmax(dim=-1)
        o_lat = torch.bmm(probs, latent[..., :rank])  # [b, H, rank]
        # W_UV after: [H, b, rank] @ [H, rank, v]
        out = torch.bmm(o_lat.transpose(0, 1), w_uv.float().transpose(1, 2))
        return out.transpose(0, 1)

    @staticmethod
    def _prefill(q, latent, dims, scale, w_uk, w_uv) -> torch.Tensor:
        """Decompressed form for one sequence: q [q_len, H, nope + rope] over its context's
        latent rows [seq_len, rank + rope] -> [q_len, H, v]."""
        rank = dims.kv_lora_rank
        q, latent, w_uk, w_uv = q.float(), latent.float(), w_uk.float(), w_uv.float()
        c_kv, k_pe = latent[:, :rank], latent[:, rank:]
        heads, seq_len, q_len = q.shape[1], latent.shape[0], q.shape[0]
        k_nope = torch.matmul(c_kv, w_uk.transpose(1, 2))  # [H, seq, nope]
        v = torch.matmul(c_kv, w_uv.transpose(1, 2))  # [H, seq, v]
        k = torch.cat((k_nope, k_pe.expand(heads, seq_len, -1)), dim=-1)
        mask = None
        if q_len != seq_len:  # a chunk after cached context: bottom-right causal
            mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k, v, attn_mask=mask, is_causal=mask is None, scale=scale
        )
        return o.transpose(0, 1)


def _rows(flat: torch.Tensor, slots: torch.Tensor, k_scale: torch.Tensor | None) -> torch.Tensor:
    """The latent rows at `slots` as float32; an FP8 cache's dequantized (stored * k_scale)."""
    rows = flat[slots]
    return rows.float() if k_scale is None else dequantize_kv(rows, k_scale)
