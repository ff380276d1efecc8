"""The Mamba2 mixer layer shared by the Mamba2 hybrids (Bamba; Nemotron-H, Falcon-H1 and
Granite 4 hybrids have the same mixer).

in_proj splits each token into a gate z, the convolution's input xBC and a raw step dt
per head; the platform's linear-attention backend (variant "mamba2") runs the causal
convolution, the discretization and the SSD scan over the sequence's recurrent state
(reference: `tokenmill.platforms.ops.mamba2.mamba2_mixer`); the gated RMSNorm and out_proj follow.
Parameter names are HF's (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`,
`out_proj`); the checkpoint's conv1d weight [C, 1, K] loads as [C, K].

Tensor parallel (built at one rank's heads and B/C groups, `dims`): a rank owns a
contiguous run of heads with the groups they read, so its share of in_proj's rows is five
runs of the checkpoint's [z | x | B | C | dt] (`Pieces`), of the conv's channels three
([x | B | C]); dt_bias, A_log, D by head, the norm's weight by channel (its groups stay
whole on one rank), out_proj's columns, which all-reduces. The recurrent state holds
this rank's heads only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.model.linear import LayerBuilder
from tokenmill.model.parallel import Pieces, Slice
from tokenmill.platforms.interfaces import AttentionMetadata, AttentionSpec, LinearAttentionBackend
from tokenmill.platforms.ops.mamba2 import Mamba2Dims, Mamba2Inputs, Mamba2Weights, gated_rms_norm


def mamba2_dims(hf_config: Any, prefix: str = "mamba_") -> Mamba2Dims:
    """The mixer's shapes from an HF config whose fields are `{prefix}n_heads`,
    `{prefix}d_head`, `{prefix}n_groups`, `{prefix}d_state`, `{prefix}d_conv`,
    `{prefix}chunk_size` (Bamba, Granite 4 hybrid, Falcon-H1) and `time_step_limit`."""
    limit = getattr(hf_config, "time_step_limit", None) or (0.0, float("inf"))
    return Mamba2Dims(
        num_heads=getattr(hf_config, f"{prefix}n_heads"),
        head_dim=getattr(hf_config, f"{prefix}d_head"),
        num_groups=getattr(hf_config, f"{prefix}n_groups"),
        state_size=getattr(hf_config, f"{prefix}d_state"),
        conv_kernel=getattr(hf_config, f"{prefix}d_conv"),
        chunk_size=getattr(hf_config, f"{prefix}chunk_size"),
        dt_limit=(float(limit[0]), float(limit[1])),
    )


class Mamba2Mixer(nn.Module):
    """One Mamba2 mixer: projections and norm here, convolution and scan in the backend."""

    def __init__(
        self,
        hidden_size: int,
        dims: Mamba2Dims,
        *,
        backend: LinearAttentionBackend,
        spec: AttentionSpec,
        eps: float,
        conv_bias: bool,
        proj_bias: bool,
        build: LayerBuilder,
        prefix: str,
    ) -> None:
        super().__init__()
        self.dims = dims
        self.spec = spec
        self.backend = backend
        self.eps = eps
        dtype = build.dtype
        inner = dims.intermediate_size
        proj, conv, x, per_head = _shares(dims, build.tp.rank_in_group, build.tp.world_size)
        self.in_proj = build.column(
            f"{prefix}.in_proj", hidden_size, inner + dims.conv_dim + dims.num_heads, proj_bias,
            shards=proj,
        )
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(dims.conv_dim, dims.conv_kernel, dtype=dtype))
        self.conv1d.bias = (
            nn.Parameter(torch.empty(dims.conv_dim, dtype=dtype)) if conv_bias else None
        )
        self.conv1d.shard_rules = build.rules({"weight": conv, "bias": conv})
        self.dt_bias = nn.Parameter(torch.empty(dims.num_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(dims.num_heads, dtype=dtype))
        self.D = nn.Parameter(torch.empty(dims.num_heads, dtype=dtype))
        self.shard_rules = build.rules({"dt_bias": per_head, "A_log": per_head, "D": per_head})
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(inner, dtype=dtype))
        self.norm.shard_rules = build.rules({"weight": x})
        self.out_proj = build.row(f"{prefix}.out_proj", inner, hidden_size, proj_bias)

    def scan_weights(self) -> Mamba2Weights:
        return Mamba2Weights(
            conv_weight=self.conv1d.weight,
            conv_bias=self.conv1d.bias,
            dt_bias=self.dt_bias,
            A=-torch.exp(self.A_log.float()),
            D=self.D,
        )

    def forward(
        self, hidden: torch.Tensor, state_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; the backend reads and writes the
        step's sequences' recurrent states in `state_cache` (the layer's arena pages,
        uint8) where `metadata.recurrent` says."""
        dims = self.dims
        gate, xbc, dt = self.in_proj(hidden).split(
            [dims.intermediate_size, dims.conv_dim, dims.num_heads], dim=-1
        )
        inputs = Mamba2Inputs(xbc, dt, self.scan_weights(), dims)
        y = self.backend.forward(self.spec, inputs, state_cache, metadata)
        group = dims.intermediate_size // dims.num_groups
        y = gated_rms_norm(y, gate, self.norm.weight, self.eps, group)
        return self.out_proj(y)


def _shares(dims: Mamba2Dims, rank: int, t: int) -> tuple[Pieces, Pieces, Slice, Slice]:
    """Rank `rank` of `t`'s checkpoint rows (`dims`: its share): of in_proj, of the conv
    channels, of the x channels (the norm's), of the per-head tensors."""
    inner, bc, heads = dims.intermediate_size, dims.num_groups * dims.state_size, dims.num_heads
    x = Slice(0, rank * inner, inner)  # offsets into the whole model's runs below
    b = Slice(0, t * inner + rank * bc, bc)
    c = Slice(0, t * (inner + bc) + rank * bc, bc)
    conv = Pieces((x, b, c))
    # in_proj: [z (t inner) | conv channels (t (inner + 2 bc)) | dt (t heads)]
    shift = t * inner
    proj = Pieces((
        x,
        *(Slice(0, s.start + shift, s.length) for s in conv.slices),
        Slice(0, shift + t * (inner + 2 * bc) + rank * heads, heads),
    ))
    return proj, conv, x, Slice(0, rank * heads, heads)
