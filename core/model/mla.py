"""The multi-head latent attention layer (DeepSeek-V2/V3, Kimi Linear's full-attention layers).

Parameters keep transformers' names: `q_proj` (or `q_a_proj`, `q_a_layernorm`, `q_b_proj`
with a q LoRA rank), `kv_a_proj_with_mqa` (hidden -> kv_lora_rank + rope), `kv_a_layernorm`,
`kv_b_proj` (kv_lora_rank -> heads x (nope + v): the up-projections W_UK and W_UV, which
the backend gets as views), `o_proj`. The layer computes the latent row of each token
(normalised c_kv | rotated k_pe), the query (q_nope | rotated q_pe), and hands both to the
platform's MLA backend (`AttentionBackend.forward` for the MLA kind), which caches the
latent rows and attends; `o_proj` follows.

Rotary: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3)... (`rope_interleave`); the
layer gathers the even then the odd channels of q_pe and k_pe and applies the ordinary
rotate-half rotary, which is the same rotation (and a dot product does not care about a
permutation both sides share). Kimi's MLA layers have no rotary (NoPE): `rotary` None.

Tensor parallel splits the layer by heads (built at this rank's heads): q (or q_b) and
kv_b keep this rank's heads' rows, o_proj its columns and all-reduces. The latent path
(q_a, kv_a_proj_with_mqa and their norms) is replicated, and so is the latent cache:
every rank caches each token's whole latent row (kv_lora_rank + rope dims), as vLLM
does, since the up-projections of every rank's heads read all of it. Under sequence
parallel the layer all-gathers its token slice first and o_proj reduce-scatters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.model.kv_scales import add_kv_scales, kv_cache_args
from tokenmill.model.layers import RMSNorm, RotaryEmbedding
from tokenmill.model.linear import LayerBuilder
from tokenmill.platforms.interfaces import (
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
    AttentionSpec,
    MLADims,
)


def mla_spec(hf_config: Any, dtype: torch.dtype, block_size: int, scale: float) -> AttentionSpec:
    """The MLA spec of a DeepSeek-style config's attention layers."""
    dims = MLADims(
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_head_dim=hf_config.qk_nope_head_dim,
        qk_rope_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
    )
    return AttentionSpec(
        kind=AttentionKind.MLA, num_heads=hf_config.num_attention_heads, num_kv_heads=1,
        head_size=dims.latent_size, dtype=dtype, block_size=block_size, scale=scale, mla=dims,
    )


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...) along the last dim."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAAttention(nn.Module):
    """Multi-head latent attention over the platform's MLA backend (see the module doc)."""

    def __init__(
        self,
        *,
        hf_config: Any,
        spec: AttentionSpec,
        rotary: RotaryEmbedding | None,
        rope_interleave: bool,
        backend: AttentionBackend,
        build: LayerBuilder,
        prefix: str,
    ) -> None:
        super().__init__()
        dims = spec.mla
        ops, dtype = build.ops, build.dtype
        hidden, heads = hf_config.hidden_size, spec.num_heads
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.spec, self.dims, self.num_heads = spec, dims, heads
        q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        q_rows = heads * dims.qk_head_dim  # this rank's heads'
        if q_lora_rank is None:
            self.q_proj = build.column(f"{prefix}.q_proj", hidden, q_rows, False)
        else:
            self.q_a_proj = build.replicated(f"{prefix}.q_a_proj", hidden, q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6, ops, dtype)
            self.q_b_proj = build.column(f"{prefix}.q_b_proj", q_lora_rank, q_rows, False)
        self.kv_a_proj_with_mqa = build.replicated(
            f"{prefix}.kv_a_proj_with_mqa", hidden, dims.latent_size, bias
        )
        # transformers builds these norms with its default eps (1e-6), not rms_norm_eps
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, 1e-6, ops, dtype)
        self.kv_b_proj = build.column(  # dense: up_projections reads its weight
            f"{prefix}.kv_b_proj", dims.kv_lora_rank,
            heads * (dims.qk_nope_head_dim + dims.v_head_dim), False, dense=True,
        )
        self.o_proj = build.row(f"{prefix}.o_proj", heads * dims.v_head_dim, hidden, bias)
        self.rope_interleave = rope_interleave
        self.__dict__["rotary"] = rotary  # shared by every layer: not a submodule
        self.backend = backend
        self.sp = build.sp  # the latent path and every head need every token
        add_kv_scales(self, spec)  # a quantized latent cache's scale ([1]; v_scale unused)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_uk [H, nope, rank], w_uv [H, v, rank]): views of `kv_b_proj.weight`."""
        d = self.dims
        w = self.kv_b_proj.weight.view(self.num_heads, d.qk_nope_head_dim + d.v_head_dim,
                                       d.kv_lora_rank)
        return w[:, : d.qk_nope_head_dim], w[:, d.qk_nope_head_dim :]

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        d = self.dims
        if self.sp is not None:  # the latent path and every head need every token
            hidden = self.sp.gather(hidden)
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(-1, self.num_heads, d.qk_head_dim)
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [d.kv_lora_rank, d.qk_rope_head_dim], dim=-1
        )
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        k_pe = k_pe.unsqueeze(1)
        if self.rotary is not None:
            if self.rope_interleave:
                q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
            q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.contiguous())
        query = torch.cat((q_nope, q_pe), dim=-1)
        latent = torch.cat((c_kv.unsqueeze(1), k_pe), dim=-1)  # [T, 1, rank + rope]
        w_uk, w_uv = self.up_projections()
        spec, scales = kv_cache_args(self, latent, None)  # an FP8 cache's scale (or calibration)
        out = self.backend.forward(
            spec, query, latent, None, kv_cache, metadata, w_uk=w_uk, w_uv=w_uv, **scales,
        )
        return self.o_proj(out.reshape(-1, self.num_heads * d.v_head_dim))
